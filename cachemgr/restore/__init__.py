"""Data from the store into the cache: a whole evicted file back (`wholefile`), the chunks a
read needs (`chunkfetch`: from peers, cachemgr.peer, before the store), a committed set's files
ahead of its readers (`prefetch`), composed by `restorer.Restorer`, the read-through the core
calls (cachemgr.core.hooks.ReadThrough). It knows nothing of tiering: the engine
(cachemgr.engine) gives it what it needs from there (room, the live members) as callables.
"""
