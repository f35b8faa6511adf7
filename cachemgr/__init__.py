"""cachemgr: the cache manager behind ckptfs.

Everything below the FUSE adapter, in layers, each importing only the layers below it
(scripts/lint.sh checks it with import-linter, `[tool.importlinter]` in pyproject.toml):

    tiering/    committed sets out to the store, other nodes' sets in (commit, upload, publish)
    restore/    data from the store into the cache (fetch, chunk reads, prefetch)
    core/       one cache directory: the index, the cache files, POSIX semantics over them
    transfer/   one cache file to or from one object (uploads, ranged reads, downloads)
    format/     what the bytes in the store mean (keys, manifests, objects, validation)
    store/      the object-store seam and its backends (file://, s3://)
    host/       the node's OS: private files, idle-priority threads

`core` and `transfer` are independent of each other. `ckptfs/` (the FUSE adapter, the daemon,
the CLI) sits above all of them; docs/ARCHITECTURE.md draws the data flow.

Two walks, by file:

    close() of a written file   ckptfs/fuse.py release -> core/fs.py Filesystem -> core/fileops.py
                                FileOps.release -> core/hooks.py FsHooks.on_close, which is
                                tiering/commit.py Committer.on_close: its upload queued
                                (tiering/uploadqueue.py) and, unless its name is a temporary one or
                                it is in an open directory set, the file committed as a set
                                (core/sets.py)
    a set published             tiering/uploadqueue.py UploadQueue uploads each file
                                (transfer/upload.py); when the set has all its objects,
                                tiering/publish.py Publisher checks them and PUTs the manifest
                                (format/manifest.py), conditionally (store/); other nodes see
                                it at their next listing (tiering/remote.py, materialise.py)
"""
