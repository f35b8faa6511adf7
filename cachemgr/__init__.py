"""cachemgr: the cache manager behind ckptfs.

Everything below the FUSE adapter: the durable local state of a mount (the cache index in
SQLite and the cache files holding file data), the filesystem semantics built on them, and the
tiering of committed sets to an object store (commit, upload, publish, restore). `ckptfs/` only
translates kernel requests into calls on this package; docs/ARCHITECTURE.md draws the modules
and the data flow between them.

The leaves import nothing above them: `store/` (the object-store seam and its backends),
`objects` (what a stored object is), `transfer` (moving one file to or from one object),
`compress`, `names`, `keys`, `validate`, `manifest`, `dcp`, `nodefiles`.
"""
