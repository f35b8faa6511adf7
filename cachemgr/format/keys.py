"""Store keys made from set paths (docs/FORMAT.md "Layout"): every valid path maps to exactly
one key that every store can hold.

A key is *storable* when it is at most 1,024 bytes (S3's limit), has at most 200
'/'-separated components and none over 255 bytes (a file:// store's file names and depth).
`manifests/<path>.json` and `parts/<dir>/@<node>.json` are used as they are when storable;
otherwise (a 251-255 byte name, whose `<name>.json` is too long; an escaped name of up to 765
characters; a very deep path) the path is replaced by the sha256 of its escaped form under the
component `LONG_KEY_DIR`: `manifests/%25/<sha256>.json`, `parts/%25/<sha256>/@<node>.json`.
"%25" is never a component of an escaped path (cachemgr.format.names: the escaped form of the name
"%" is "%", of "%25" is "%2525"), so a hashed key is never the key of another path. A hashed
key does not say its path: readers take it from the document, and check that the document's
path maps back to the key it was read from.

Only the standard library: scripts/ckpt_restore.py uses it without ckptfs installed.
"""

from __future__ import annotations

import hashlib

LONG_KEY_DIR = "%25"
MAX_KEY_BYTES = 1024
MAX_KEY_COMPONENT_BYTES = 255
MAX_KEY_COMPONENTS = 200  # a file:// store refuses keys deeper than 256 components
MANIFEST_PREFIX = "manifests/"
MANIFEST_SUFFIX = ".json"
PARTS_PREFIX = "parts/"
# probe/: scratch objects of a mount's conditional-write probe, reserved by the store seam
# itself (cachemgr.store.base.PROBE_PREFIX, docs/STORES.md)
LONG_PARTS_PREFIX = f"{PARTS_PREFIX}{LONG_KEY_DIR}/"


def storable(key: str) -> bool:
    b = key.encode("utf-8", "surrogatepass")
    parts = b.split(b"/")
    return len(b) <= MAX_KEY_BYTES and len(parts) <= MAX_KEY_COMPONENTS and \
        all(len(c) <= MAX_KEY_COMPONENT_BYTES for c in parts)


def path_hash(path: str) -> str:
    return hashlib.sha256(path.encode("utf-8", "surrogatepass")).hexdigest()


def manifest_key(path: str) -> str:
    """The key of the manifest of the set at `path` (escaped form)."""
    key = MANIFEST_PREFIX + path + MANIFEST_SUFFIX
    if storable(key):
        return key
    return f"{MANIFEST_PREFIX}{LONG_KEY_DIR}/{path_hash(path)}{MANIFEST_SUFFIX}"


def is_manifest_key(key: str) -> bool:
    return key.startswith(MANIFEST_PREFIX) and key.endswith(MANIFEST_SUFFIX)


def path_of_manifest_key(key: str) -> str | None:
    """The set path a manifest key names, or None: not a manifest key, or a hashed key (whose
    path only its document tells)."""
    if not is_manifest_key(key) or key.startswith(f"{MANIFEST_PREFIX}{LONG_KEY_DIR}/"):
        return None
    path = key[len(MANIFEST_PREFIX):-len(MANIFEST_SUFFIX)]
    return path if manifest_key(path) == key else None


def part_key(dir_path: str, node: str) -> str:
    """The key of `node`'s part record of directory `dir_path` (escaped form)."""
    key = f"{PARTS_PREFIX}{dir_path}/@{node}.json"
    return key if storable(key) else f"{LONG_PARTS_PREFIX}{path_hash(dir_path)}/@{node}.json"
