"""File names that are not UTF-8 (Linux names are bytes): the escaped form of cachemgr.format.names
(docs/FORMAT.md "Names"), in manifests and part records too; plus names with '%' and non-ASCII
UTF-8, whose keys and manifests must stay exactly what they always were. (Sets holding such names
through real mounts: tests/mount/test_names_mount.py.)
"""

from __future__ import annotations

import json

import ckpt_restore
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachemgr.format import manifest as mf
from cachemgr.format import names
from cachemgr.store import StoreError
from cachemgr.tiering import parts
from tests.names_helpers import _strict

# ----------------------------------------------------------------------------------------------
# the escaping itself

names_bytes = st.binary(min_size=1, max_size=40).filter(lambda b: b"/" not in b and b"\0" not in b)
# Names mixing the bytes that matter: '%', hex digits, UTF-8 lead/continuation bytes, 0xFF.
tricky = st.lists(st.sampled_from([b"%", b"2", b"5", b"F", b"C3", b"A9", b"\xc3", b"\xa9",
                                   b"\xff", b"\xe9", b"a", "é".encode(), b"%25", b"%FF"]),
                  min_size=1, max_size=8).map(b"".join)


@pytest.mark.parametrize("name, form", [
    ("ckpt-é.pt".encode(), "ckpt-é.pt"),
    (b"50%.pt", "50%.pt"),
    (b"a%20b", "a%20b"),
    (b"x%c3", "x%c3"),
    (b"ckpt-\xff.pt", "ckpt-%FF.pt"),
    (b"step_\xe9\xff%", "step_%E9%FF%25"),
    (b"ckpt-%C3%A9.pt", "ckpt-%25C3%25A9.pt"),
    (b"%25", "%2525"),
    (b"\xc3", "%C3"),
])
def test_escaped_forms_of_the_format_doc(name, form):
    assert names.escape_name(name) == form
    assert names.unescape_name(form) == name
    assert ckpt_restore.unescape_name(form) == name


@settings(max_examples=400, deadline=None)
@given(st.one_of(names_bytes, tricky))
def test_escape_round_trips_and_is_valid_utf8(name):
    form = names.escape_name(name)
    form.encode("utf-8")  # strict: no surrogates, a valid S3 key / SQLite text / JSON string
    assert names.unescape_name(form) == name
    assert ckpt_restore.unescape_name(form) == name  # the restore script reads it the same way
    assert names.is_canonical_path(form)
    path = name + b"/" + name
    assert names.escape_path(path) == form + "/" + form
    assert names.unescape_path(names.escape_path(path)) == path


@settings(max_examples=300, deadline=None)
@given(st.text(min_size=1, max_size=30).filter(lambda s: "/" not in s and "\0" not in s))
def test_valid_utf8_names_keep_their_text_unless_they_hold_an_escape(text):
    try:
        raw = text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates are not names
        return
    form = names.escape_name(raw)
    if not names.is_escaped(text):
        assert form == text  # every key such a name ever had is unchanged
    else:
        assert form != text and names.unescape_name(form) == raw


def test_no_two_names_share_a_form():
    cands = [b"a%FF", b"a\xff", b"a%25FF", b"a%2525FF", b"a%", b"a%25", b"a\xff%", b"a%C3%A9",
             "aé".encode(), b"a\xc3\xa9%25", b"a%c3", b"a%20"]
    forms = [names.escape_name(c) for c in cands]
    assert len(set(forms)) == len(cands), forms
    assert not names.is_canonical_path("a%FFb%")  # a bare '%' beside escapes: not written
    assert not names.is_canonical_path("a\udcff")


def test_object_keys_are_valid_utf8_and_plain_names_keep_theirs():
    from cachemgr.tiering.uploadqueue import object_key

    assert object_key("n1", 7, 2, "ckpt/ckpt-é.pt") == "data/n1/7/2/ckpt-é.pt"
    assert object_key("n1", 7, 2, "ckpt/50%.pt") == "data/n1/7/2/50%.pt"
    assert object_key("n1", 7, 2, "c/" + "x" * 120) == "data/n1/7/2/" + "x" * 100
    long_form = names.escape_name(b"\xff" * 255)
    key = object_key("n1", 7, 2, "c/" + long_form)
    assert key.endswith("%FF") and len(key.rsplit("/", 1)[1]) <= 100
    key = object_key("n1", 7, 2, "c/" + "x" * 98 + long_form)  # cut inside an escape
    assert key.rsplit("/", 1)[1] == "x" * 98


# ----------------------------------------------------------------------------------------------
# manifests and part records


def _obj(key: str) -> dict:
    return {"key": key, "size": 1, "stored_size": 1, "crc32c": 0, "compression": "none",
            "frame_size": 0, "frames": None, "chunk_size": 4194304, "chunk_crcs": [0]}


def _manifest(path: str, rels: list[str], dirs=(), links=()) -> dict:
    files = [{"path": r, "size": 1, "mode": 0o644, "mtime_ns": 1, "object": _obj(f"data/n/{i}/1/x")}
             for i, r in enumerate(rels)]
    layout = {"dirs": [{"path": d, "mode": 0o755, "mtime_ns": 1} for d in dirs],
              "symlinks": [{"path": p, "target": t} for p, t in links], "mode": 0o755}
    return mf.build(path=path, kind="dir", seq=1, node="n", reason="dcp", committed_ns=1,
                    layout=layout, files=files)


def test_plain_manifests_stay_version_1_byte_for_byte():
    m = _manifest("ckpt/step-é", ["50%.pt", "a%20b", "x%c3"], dirs=["sub"],
                  links=[("latest", "50%.pt")])
    assert m["version"] == 1
    assert mf.dumps(m) == json.dumps(m, indent=1, sort_keys=True).encode()  # as always written
    assert mf.loads(mf.dumps(m)) == m


def test_escaped_manifests_are_version_2_strict_json_and_read_back():
    m = _manifest("ckpt/step_%FF", ["__0_0.distcp", "sub%E9/x%FE.bin", "50%.pt"],
                  dirs=["sub%E9", "empty%FE%25"], links=[("link%FF", "../t%FF/x")])
    assert m["version"] == 2
    data = mf.dumps(m)
    assert b"\\ud" not in data
    assert _strict(data) == mf.loads(data) == m
    # A version-2 field that is not in the escaped form is refused, not guessed at.
    bad = json.loads(data)
    bad["files"][0]["path"] = "a%FFb%"
    with pytest.raises(mf.ManifestError):
        mf.loads(json.dumps(bad).encode())
    bad["version"] = 3
    with pytest.raises(mf.ManifestError):
        mf.loads(json.dumps(bad).encode())


def test_legacy_surrogates_are_read_and_written_as_escapes():
    # An index or a store of an older ckptfs holds undecodable bytes as surrogates (a set
    # layout's empty directory b"d\xff", a symlink target): they become escapes, exactly.
    m = _manifest("ckpt/s", ["f"], dirs=["d\udcff"], links=[("l", "t\udcfe")])
    assert m["version"] == 2 and m["dirs"][0]["path"] == "d%FF"
    assert m["symlinks"][0]["target"] == "t%FE"
    old = json.loads(mf.dumps(_manifest("ckpt/s", ["f"])))
    old["dirs"] = [{"path": "d\udcff", "mode": 0o755, "mtime_ns": 1}]
    got = mf.loads(json.dumps(old).encode())  # ensure_ascii: "d\\udcff" in the JSON
    assert got["version"] == 1 and got["dirs"][0]["path"] == "d%FF"
    # A version-1 literal name that looks escaped reads as its escaped form.
    old["path"] = "ckpt/x%C3"
    assert mf.loads(json.dumps(old).encode())["path"] == "ckpt/x%25C3"
    # Nothing writes a lone surrogate: refused as a store error (the set fails with it).
    doc = _manifest("ckpt/s", ["f"])
    doc["commit"]["reason"] = "x\udcff"
    with pytest.raises(StoreError):
        mf.dumps(doc)


def test_part_records_with_escaped_names():
    d = names.escape_path(b"run/step_\xff.tmp")
    assert d == "run/step_%FF.tmp"
    key = parts.part_key(d, "6d60a523")
    assert key == "parts/run/step_%FF.tmp/@6d60a523.json"
    assert parts.parse_key(key) == (d, "6d60a523")
    rec = parts.build("n1", d, [{"name": "x%FE.bin", "size": 3, "mode": 0o644, "mtime_ns": 1,
                                 "object": None},
                                {"name": "__0_0.distcp", "size": 3, "mode": 0o644,
                                 "mtime_ns": 1, "object": None}])
    assert rec["version"] == 2
    data = parts.dumps(rec)
    assert _strict(data) == parts.loads(data) == rec
    plain = parts.build("n1", "run/step_1.tmp", [{"name": "50%.pt", "size": 3, "mode": 0o644,
                                                  "mtime_ns": 1, "object": None}])
    assert plain["version"] == 1
    assert parts.dumps(plain) == json.dumps(plain, sort_keys=True).encode()
    legacy = dict(plain, dir="run/s\udcff", files=[{"name": "f\udcfe", "size": 1}])
    got = parts.loads(json.dumps(legacy).encode())
    assert got["dir"] == "run/s%FF" and got["files"][0]["name"] == "f%FE"
    for bad_name in ("a/b", ""):
        with pytest.raises(parts.PartError):
            parts.loads(json.dumps(dict(rec, files=[{"name": bad_name, "size": 1}])).encode())
