"""What the bytes in the object store mean, read alike by the daemon, `ckptfs restore` and
scripts/ckpt_restore.py: the key layout (`keys`), path escaping (`names`), the validation of every
document read from the store (`validate`), manifests (`manifest`), stored objects and their
chunk geometry (`objects`), lz4 framing (`compress`), DCP metadata (`dcp`), and the synchronous
reader of stored sets for the tools (`storeread`). `keys`, `names`, `validate`, `compress` and
`storeread` need only the standard library, lz4 and crc32c (scripts/ckpt_restore.py runs
without trio or boto3): keep this package's `__init__` empty.
"""
