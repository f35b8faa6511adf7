-- ckptfs cache index, layout version 1. This file is the reference for the on-disk schema.
-- The layout version is stored twice on purpose: in PRAGMA user_version (checked on open, so a
-- newer or older daemon refuses an index it does not understand) and in meta('layout_version')
-- for humans poking at the file with the sqlite3 shell.
--
-- Durability: the database runs in WAL mode with synchronous=NORMAL. Every metadata operation
-- (create, mkdir, unlink, rename, setattr, ...) is one committed transaction, so it survives a
-- crash of the daemon (the WAL is in the OS page cache). fsync()/fsyncdir() additionally commit
-- with synchronous=FULL, which syncs the WAL and so everything committed before it.

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
    target   BLOB                          -- symlink target; NULL for every other type
);

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

-- Extended attributes. system.* names are refused (ENOTSUP) before they get here.
CREATE TABLE xattrs (
    ino   INTEGER NOT NULL REFERENCES inodes(ino),
    name  BLOB    NOT NULL,
    value BLOB    NOT NULL,
    PRIMARY KEY (ino, name)
);
