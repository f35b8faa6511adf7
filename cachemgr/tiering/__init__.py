"""Committed sets out to the object store and other nodes' sets in: the core's hooks
(`commit`), the upload queue (`uploads`), publishing manifests in commit order (`publish`),
other nodes' files of a set (`gather`, `parts`, `members`), the remote namespace
(`remote`, `materialise`), the cache-size policy (`space`), progress and `ckptfs wait`
(`progress`), wake-ups between services (`signals`); `services.Tiering` builds and runs them.
How a set is published: `commit` -> `uploads` -> `publish`.
"""
