"""Committed sets out to the object store and other nodes' sets in: the core's hooks
(`commit`), the upload queue (`uploadqueue`), publishing manifests in commit order (`publish`),
other nodes' files of a set (`gather`, `parts`, `members`), the remote namespace
(`remote`, `materialise`), the cache-size policy (`space`), progress and `ckptfs wait`
(`progress`), wake-ups between services (`signals`), the index's memory of ended sets
(`history`); with --peers, replicas to buddies (`replicate`, on the routes of `replicaproto`),
a lost node's sets published by its buddy (`takeover`) and the namespace peers hold
(`peernamespace`). The engine (cachemgr.engine) builds and runs them.
How a set is published: `commit` -> `uploadqueue` -> `publish`.
"""
