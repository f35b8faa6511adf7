"""File names as text: how a name (Linux: any bytes but '/' and NUL) becomes the string ckptfs
uses for set paths in the index, in object keys, manifest keys, part record keys and the JSON
documents of the store (docs/FORMAT.md "Names"), and back, exactly.

The *escaped form* of a name:

  * a name that is valid UTF-8 and holds none of the escape sequences below is itself (so every
    key ckptfs ever wrote for such a name is unchanged, byte for byte);
  * any other name is written with every byte that is not part of a valid UTF-8 sequence as
    `%XX` (two uppercase hex digits, always 80-FF) and every '%' as `%25`; everything else is
    kept as it is.

The escape sequences are exactly `%25` and `%80`..`%FF` (uppercase). A string is unescaped iff
it holds one of them. A path's form is its components' forms joined by '/' (escaping never
makes or removes a '/', and 0x2F is never inside a multi-byte UTF-8 sequence), so the form of a
directory is a prefix of the forms of everything under it: `parts/<dir>/` and `at_or_under`
keep working on the escaped strings.

Why this escaping:

  * The result is always valid UTF-8 (S3 keys, SQLite TEXT, JSON that every parser accepts),
    reversible, and readable: `aws s3 ls` shows `ckpt-%FF.pt` for b"ckpt-\\xff.pt".
  * No escaping can leave every valid-UTF-8 name unchanged and still be reversible: the escaped
    string of a non-UTF-8 name is itself valid UTF-8, hence also a possible name, and both would
    get one key. Some valid names must change; this choice makes that set as small as it can
    be while keeping the rule short: only names that literally contain `%25` or `%80`..`%FF`
    (what a URL-encoded non-ASCII name looks like, e.g. "ckpt-%C3%A9.pt"). Plain
    percent-encoding of every '%' would also have changed "50%.pt" or "lr=1%"; names with
    "%20" or "%2F" or lowercase "%c3" keep their form too. A store written before this
    escaping existed holds such a literal name under a key that now reads as another name:
    those sets (only those) are not restored by this version (logged).
  * A set and its object keys, manifest key, part record and manifest fields all use the same
    string, so nothing above this module needs to know about bytes.
"""

from __future__ import annotations

import re

# The escape sequences this scheme writes: '%' itself, and the bytes that can fail to be UTF-8
# (every byte below 0x80 is a valid one-byte sequence).
_ESCAPE = re.compile(r"%(25|[89A-F][0-9A-F])")


def is_escaped(s: str) -> bool:
    """True if the escaped-form string `s` (a name, a path) holds an escape, i.e. is not the
    name's UTF-8 text as it is."""
    return _ESCAPE.search(s) is not None


def escape_name(name: bytes) -> str:
    """The escaped form of one name (or of any byte string: a path, a symlink target; '/' is
    never escaped, but see escape_path for a path)."""
    try:
        s = name.decode("utf-8")
    except UnicodeDecodeError:
        pass
    else:
        if not is_escaped(s):
            return s
    # surrogateescape maps exactly the bytes that are not part of a valid UTF-8 sequence to
    # U+DC80..U+DCFF, one per byte.
    out = []
    for ch in name.decode("utf-8", "surrogateescape"):
        if ch == "%":
            out.append("%25")
        elif "\udc80" <= ch <= "\udcff":
            out.append(f"%{ord(ch) - 0xDC00:02X}")
        else:
            out.append(ch)
    return "".join(out)


def unescape_name(s: str) -> bytes:
    """The name (bytes) of an escaped-form string; inverse of escape_name."""
    if not is_escaped(s):
        return s.encode("utf-8")
    pieces = _ESCAPE.split(s)  # literal, hex, literal, hex, ..., literal
    out = bytearray()
    for i, piece in enumerate(pieces):
        out += bytes((int(piece, 16),)) if i % 2 else piece.encode("utf-8")
    return bytes(out)


def escape_path(path: bytes) -> str:
    """The escaped form of a '/'-separated path (or symlink target): component by component."""
    return "/".join(escape_name(p) for p in path.split(b"/"))


def unescape_path(s: str) -> bytes:
    return b"/".join(unescape_name(p) for p in s.split("/"))


def is_canonical_path(s: str) -> bool:
    """True if `s` is the escaped form of some path (what a reader of the store checks before
    trusting a name: e.g. "a%FFb%" or "%41" are not forms this scheme writes)."""
    try:
        return escape_path(unescape_path(s)) == s
    except UnicodeEncodeError:  # lone surrogates
        return False


def from_str(path: str) -> str:
    """The escaped form of a path given as a str the way Python's os functions give one
    (undecodable bytes as surrogates U+DC80..U+DCFF): sys.argv, os.listdir(str), the paths of
    `ckptfs commit/wait/prefetch` requests, and the path fields of version-1 documents (which
    hold names as they are)."""
    return escape_path(path.encode("utf-8", "surrogateescape"))


def to_str(s: str) -> str:
    """An escaped-form path as a str for Python's os functions (inverse of from_str)."""
    return unescape_path(s).decode("utf-8", "surrogateescape")
