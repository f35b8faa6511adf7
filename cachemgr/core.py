"""Compatibility shim: the filesystem core moved to cachemgr.fs and the modules it is composed
of (cachemgr.inodes, filecache, handles, namespace, fileops, xattrs, rawtree, fsck, hooks).
Importers of `cachemgr.core` keep working for this phase of issue 11; new code imports from the
new modules."""

from __future__ import annotations

from .fileops import CoreStats
from .fs import LAYOUT, CacheFs, Filesystem
from .handles import Handle, OpenResult
from .inodes import INODE_FIELDS, Caller, Inode
from .namespace import NAME_MAX, READDIR_BATCH, RENAME_EXCHANGE, RENAME_NOREPLACE, SYMLINK_MAX
from .xattrs import XATTR_VALUE_MAX

__all__ = ["INODE_FIELDS", "LAYOUT", "NAME_MAX", "READDIR_BATCH", "RENAME_EXCHANGE",
           "RENAME_NOREPLACE", "SYMLINK_MAX", "XATTR_VALUE_MAX", "CacheFs", "Caller",
           "CoreStats", "Filesystem", "Handle", "Inode", "OpenResult"]
