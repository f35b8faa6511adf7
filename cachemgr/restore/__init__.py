"""Data from the store into the cache: a whole evicted file back (`fetch`), the chunks a read
needs (`chunkfetch`), a committed set's files ahead of its readers (`prefetch`), composed by
`restorer.Restorer`, the read-through the core calls (cachemgr.core.hooks.ReadThrough).
"""
