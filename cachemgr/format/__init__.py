"""What the bytes in the object store mean, read alike by the daemon, `ckptfs restore` and
scripts/ckpt_restore.py: the key layout (`keys`), path escaping (`names`), the validation of every
document read from the store (`validate`), manifests (`manifest`), stored objects and their
chunk geometry (`objects`), writing lz4 frames (`compress`), the one decoder of stored objects
(`decode`: every reader's, the daemon's included), DCP metadata (`dcp`), and the synchronous
reader of stored sets for the tools: its errors (`readerrors`), what a store view is
(`views`), manifests and objects (`storeread`), the script's atomic restore (`restoreto`) and
`ckptfs restore`'s resumable one (`resumable`), and the tools' blocking view of a
cachemgr.store store (`storeview`: the one store stack, the mount's). `keys`, `names`,
`validate`, `decode`, `readerrors`, `views`, `storeread`, `restoreto` and `resumable` need only
the standard library, lz4 and crc32c (scripts/ckpt_restore.py runs without trio or boto3 from
the ones its `MODULES` names, reading the store through its own views): keep this package's
`__init__` empty.
"""
