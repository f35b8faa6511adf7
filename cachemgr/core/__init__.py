"""The filesystem core: one cache directory's durable state and POSIX semantics over it, with
no object store and no FUSE. Owners first (`index`, `inodes`, `filecache`, `sets`,
`passthrough`, `xattrs`, `rawtree`: `cache.Cache` builds them), then the operations built on
them and on the layers above (`namespace`, `handles`, `fileops`), composed by `fs`; `hooks` are
the interfaces through which the core tells the layers above (tiering, restore) what happened,
and their stand-ins for a cache with no store. What happens on close(): `fileops.release`
records the close and calls `FsHooks.on_close` (cachemgr.tiering.commit).
"""
