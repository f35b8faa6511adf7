-- ckptfs cache index, layout version 1. This file is the reference for the on-disk schema.
-- The layout version is stored twice on purpose: in PRAGMA user_version (checked on open, so a
-- newer or older daemon refuses an index it does not understand) and in meta('layout_version')
-- for humans poking at the file with the sqlite3 shell.
--
-- Durability: the database runs in WAL mode with synchronous=NORMAL. Every metadata operation
-- (create, mkdir, unlink, rename, setattr, ...) is one committed transaction, so it survives a
-- crash of the daemon (the WAL is in the OS page cache). fsync()/fsyncdir() additionally commit
-- with synchronous=FULL, which syncs the WAL and so everything committed before it.
-- A full cache disk: index.reserve beside this file keeps room for these writes (see
-- cachemgr/index.py, RESERVE_BYTES); SQLITE_FULL surfaces as ENOSPC, the transaction rolled back.

CREATE TABLE meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);

-- One row per inode. Inode 1 is the root directory and always exists.
CREATE TABLE inodes (
    ino      INTEGER PRIMARY KEY,
    mode     INTEGER NOT NULL,             -- st_mode, file type bits included
    uid      INTEGER NOT NULL,
    gid      INTEGER NOT NULL,
    -- Regular files: logical size. The cache file data/<ino> is always kept at exactly this
    -- size (truncate and extending writes resize it), so after a crash the cache file's own
    -- size is the truth and recovery copies it back here (writes update size in memory only).
    -- Symlinks: length of target. Directories: 0.
    size     INTEGER NOT NULL DEFAULT 0,
    atime_ns INTEGER NOT NULL,
    mtime_ns INTEGER NOT NULL,
    ctime_ns INTEGER NOT NULL,
    -- Number of directory entries naming this inode; for directories 2 + number of
    -- subdirectories (POSIX convention). 0 = unlinked while still open or known to the
    -- kernel: the row and its cache file are kept until the last release/forget, and
    -- recovery deletes every nlink = 0 row left behind by a crash.
    nlink    INTEGER NOT NULL,
    rdev     INTEGER NOT NULL DEFAULT 0,
    target   BLOB,                         -- symlink target; NULL for every other type
    -- Tiering (regular files only). `version` is bumped by every open for writing and every
    -- truncate: (ino, version) names one immutable content of the file, which is the unit of
    -- upload. `writing` = 1 while some handle has the file open for writing; a crash leaves it
    -- at 1, and recovery then bumps `version` (the content after the crash is not one that
    -- was ever closed, so no commit may use it).
    version  INTEGER NOT NULL DEFAULT 0,
    writing  INTEGER NOT NULL DEFAULT 0,
    -- 1 = the cache file holds the data; 0 = evicted or restored from another node's manifest
    -- (durable in the store as `obj`; the cache file is empty until restore fills it, first
    -- extending it to the file's length; `present` says which chunks are in: cachemgr.restore).
    cached   INTEGER NOT NULL DEFAULT 1,
    -- The uploaded object (StoredObject JSON, see cachemgr/transfer.py) of content `obj_version`,
    -- or NULL if no upload of this file has finished.
    obj         TEXT,
    obj_version INTEGER,
    -- For cached = 0: bitmap of the object's chunks already in the cache file (bit i of byte
    -- i // 8 = chunk i, chunks of the object's chunk_size); NULL = none yet. When every chunk is
    -- in, cached becomes 1 and this NULL again.
    present     BLOB
);
-- The peer server's look-up of a chunk request by its object key (Index.inos_of_object): a scan
-- of every inode without it (~40 ms at 100k inodes, on the event loop). An added index, not a
-- layout change: Index.open adds it to a cache made before it.
CREATE INDEX inodes_by_obj_key ON inodes(json_extract(obj, '$.key')) WHERE obj IS NOT NULL;

-- Directory entries. `id` is the readdir offset: AUTOINCREMENT makes it strictly increasing and
-- never reused, so a listing resumed at "id > offset" reports no entry twice and skips none of
-- the entries that existed for the whole listing, whatever is created or removed meanwhile.
CREATE TABLE dentries (
    id     INTEGER PRIMARY KEY AUTOINCREMENT,
    parent INTEGER NOT NULL REFERENCES inodes(ino),
    name   BLOB    NOT NULL,
    ino    INTEGER NOT NULL REFERENCES inodes(ino),
    UNIQUE (parent, name)
);
CREATE INDEX dentries_by_ino ON dentries(ino);
-- The entries of a directory whose names end in `.distcp` (SetRegistry.is_dcp_dir, asked at
-- every close in a directory: is it a DCP save?): without it a scan of the directory's
-- entries, O(entries) per close. A partial index, so it holds only those entries; queried
-- with its own WHERE clause (Index.has_entry_like). Added, not a layout change: Index.open adds
-- it to a cache made before it.
CREATE INDEX dentries_distcp ON dentries(parent) WHERE CAST(name AS TEXT) LIKE '%.distcp';

-- Extended attributes. system.* names are refused (ENOTSUP) before they get here.
CREATE TABLE xattrs (
    ino   INTEGER NOT NULL REFERENCES inodes(ino),
    name  BLOB    NOT NULL,
    value BLOB    NOT NULL,
    PRIMARY KEY (ino, name)
);

-- Node identity (meta key 'node_id'): a random id made when the index is created; it names this
-- cache's objects in the store: data/<node_id>/<ino>/<version>/<name hint> (the hint is the
-- file's escaped name cut to 100 characters; nothing reads it back: the manifest names the key.
-- cachemgr.tiering.object_key).
-- --replicas (meta key 'replica_peers'): JSON, the peers this node offers its sets to first
-- ([node, host, port], at most K + 3), so a daemon restarted while the store is down reaches its
-- buddies at once (cachemgr.tiering.replicate.ReplicaOrigin).

-- Shard sets: one row per commit. A set is a directory (its whole subtree), a single file, or a
-- symlink, named by its path at commit time. States (see docs/SEMANTICS.md "Shard sets"):
--   committed  -> recorded; its files' uploads are queued in commit order (seq)
--   uploading  -> at least one upload of its files has started
--   durable    -> every object uploaded and verified, manifest published at manifest_key
--   failed     -> `error` says why (store refused, a file changed after commit, ...)
--   superseded -> a later commit of the same path replaced it before it became durable
--   replaced   -> was durable; a later commit of the same path is now durable instead
--   deleting   -> its path was removed through the mount (or the set was absorbed by a later
--                 set); its manifest and objects are being removed from the store, in commit
--                 order. Counts as kept for garbage collection until it is gone.
--   deleted    -> removed from the store
--   replicated -> (origin another node's id) a set another node committed, materialised from a
--                 manifest peers built from the replicas they hold (etag 'peer:<origin>:<seq>'),
--                 while the store could not be listed; replaced once the store lists its
--                 manifest (cachemgr.tiering.peerspace)
CREATE TABLE sets (
    seq          INTEGER PRIMARY KEY AUTOINCREMENT,   -- commit order
    path         TEXT    NOT NULL,                    -- relative to the mount root, no leading /
    kind         TEXT    NOT NULL,                    -- 'dir' | 'file' | 'symlink'
    root_ino     INTEGER NOT NULL,
    state        TEXT    NOT NULL,
    reason       TEXT    NOT NULL,                    -- what committed it (dcp, rename, close...)
    committed_ns INTEGER NOT NULL,
    durable_ns   INTEGER,
    error        TEXT,
    layout       TEXT    NOT NULL,                    -- JSON: dirs and symlinks of the set
    -- 'local' for sets committed on this node; else the node id of the store manifest this set
    -- was materialised from (restore on another node), with that manifest's etag.
    origin       TEXT    NOT NULL DEFAULT 'local',
    etag         TEXT
);
CREATE INDEX sets_by_path ON sets(path);
CREATE INDEX sets_by_state ON sets(state);
-- A directory's sets (SetRegistry.dir_set_of: is it a committed directory?). An added index,
-- not a layout change: Index.open adds it to a cache made before it.
CREATE INDEX sets_by_root ON sets(root_ino, seq);

-- The regular files of each set, as of the commit: content (ino, version) plus the metadata the
-- manifest records. `obj` is filled in when the upload of exactly that content has finished.
CREATE TABLE set_files (
    seq      INTEGER NOT NULL REFERENCES sets(seq),
    rel      TEXT    NOT NULL,                        -- path inside the set; '' for a file set
    ino      INTEGER NOT NULL,
    version  INTEGER NOT NULL,
    size     INTEGER NOT NULL,
    mode     INTEGER NOT NULL,
    mtime_ns INTEGER NOT NULL,
    obj      TEXT,
    PRIMARY KEY (seq, rel)
);
CREATE INDEX set_files_by_content ON set_files(ino, version);

-- Objects this node put in the store and has not deleted yet, for garbage collection: an object
-- is deleted once no kept set (committed/uploading/durable/deleting) refers to it and it is not
-- the latest upload of a live inode (cachemgr.sets.SetRegistry.garbage).
CREATE TABLE objects (
    key      TEXT PRIMARY KEY,
    ino      INTEGER NOT NULL,
    version  INTEGER NOT NULL,
    size     INTEGER NOT NULL
);
-- An object by its content (SetRegistry.object_key at every upload; the candidates of an
-- incremental GC pass, SetRegistry.garbage_of). Added, not a layout change (Index.open).
CREATE INDEX objects_by_content ON objects(ino, version);
