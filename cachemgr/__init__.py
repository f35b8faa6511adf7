"""cachemgr: the cache manager behind ckptfs.

Owns the durable local state of a mount: the cache index (tree and per-file metadata, SQLite),
the cache files holding file data, and the filesystem semantics built on them (`core.CacheFs`).
Later layers (upload, commit, eviction, prefetch, object-store backends) live here too; the FUSE
layer in `ckptfs/` only translates kernel requests into calls on this package.
"""
