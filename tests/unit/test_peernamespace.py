"""Sets from peers while the store is down (--peer-seeds, cachemgr.tiering.peernamespace;
docs/SEMANTICS.md "Replicated"): what a fresh node does with a peer's namespace answer.

The documents on their own (no mount): the namespace answer (validate.peer_namespace), its
signature (peer.proto.check_response), a held replica's chunk CRCs (validate.replica_offer) and
the objects and manifest a buddy serves a replica as (replicate.virtual_objects,
replica_manifest). Real mounts, a fresh node whose store is down and a fake peer as its only
seed: tests/mount/test_peernamespace_mount.py.
"""

from __future__ import annotations

import json
import os

import pytest

from cachemgr.format import manifest as mf
from cachemgr.format import validate
from cachemgr.format.decode import crc32c
from cachemgr.format.objects import verify_chunk
from cachemgr.peer.proto import H_SIG, check_response, sign_response
from cachemgr.tiering.replicaproto import namespace_target
from cachemgr.tiering.replicate import virtual_objects
from tests.peernamespace_helpers import (
    CHUNK,
    FAKE,
    ORIGIN,
    SECRET,
    chunk_crcs,
    descriptor,
    manifest_of,
    namespace_doc,
)

# ----------------------------------------------------------------------------------------------
# A. the documents, no mount


def _refused(doc: object) -> None:
    data = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    with pytest.raises(validate.DocumentError):
        validate.peer_namespace(data)


def test_a_valid_namespace_answer_is_read_as_it_was_sent():
    m = mf.dumps(manifest_of(descriptor({"a.pt": b"x"}))).decode()
    got = validate.peer_namespace(json.dumps(namespace_doc([m], port=4242)).encode())
    assert got == {"node": FAKE, "peers": [(FAKE, "127.0.0.1", 4242)], "sets": [m.encode()],
                   "truncated": False}


@pytest.mark.parametrize("data", [b"", b"not json", b"\xff\xfe", b"[1, 2", b"[" * 100_000,
                                  b"[]", b'"a string"', b"null"])
def test_a_namespace_answer_that_is_not_a_json_object_is_refused(data):
    _refused(data)


@pytest.mark.parametrize("over", [{"format": "ckptfs-manifest"}, {"format": None},
                                  {"version": 2}, {"version": "1"}, {"version": True},
                                  {"version": 1.0}])
def test_a_namespace_answer_of_another_format_or_version_is_refused(over):
    _refused(namespace_doc([], port=1, **over))


@pytest.mark.parametrize("node", ["", "../x", "a/b", "local", "-lead", "x" * 65, 7, None])
def test_a_namespace_answer_from_a_bad_node_id_is_refused(node):
    _refused(namespace_doc([], port=1, node=node))


@pytest.mark.parametrize("peer", [
    {"node": FAKE, "host": "bad host!", "port": 80}, {"node": FAKE, "host": "", "port": 80},
    {"node": FAKE, "host": "h" * 254, "port": 80}, {"node": FAKE, "host": 7, "port": 80},
    {"node": FAKE, "host": "127.0.0.1", "port": 0},
    {"node": FAKE, "host": "127.0.0.1", "port": 65536},
    {"node": FAKE, "host": "127.0.0.1", "port": "80"},
    {"node": FAKE, "host": "127.0.0.1", "port": True},
    {"node": FAKE, "host": "127.0.0.1"}, {"node": "../x", "host": "127.0.0.1", "port": 80},
    {"host": "127.0.0.1", "port": 80}, "127.0.0.1:80", None])
def test_a_namespace_answer_naming_a_bad_peer_is_refused(peer):
    _refused(namespace_doc([], port=1, peers=[peer]))


@pytest.mark.parametrize("sets", [[{"format": "ckptfs-manifest"}], [1], [None], ["ok", 2],
                                  "a string", {"a": "b"}, None])
def test_a_namespace_answer_whose_sets_are_not_strings_is_refused(sets):
    doc = namespace_doc([], port=1)
    doc["sets"] = sets
    _refused(doc)


def test_a_namespace_answer_whose_set_is_not_valid_text_is_refused():
    # valid JSON (json.dumps escapes it as \ud800), not text: DocumentError, never a
    # UnicodeEncodeError out of the validator (it once took a fresh node's mount down)
    _refused(namespace_doc(["\ud800"], port=1))
    _refused(namespace_doc(['{"a": "\udcff"}'], port=1))


def test_a_namespace_answer_with_too_many_sets_or_peers_is_refused():
    _refused(namespace_doc([""] * (validate.MAX_NAMESPACE_SETS + 1), port=1))
    _refused(namespace_doc([], port=1, peers="x" * 3))
    many = [{"node": FAKE, "host": "127.0.0.1", "port": 1}] * (validate.MAX_NAMESPACE_PEERS + 1)
    _refused(namespace_doc([], port=1, peers=many))


@pytest.mark.parametrize("truncated", ["missing", 0, 1, "false", None])
def test_a_namespace_answer_without_a_boolean_truncated_is_refused(truncated):
    doc = namespace_doc([], port=1)
    if truncated == "missing":
        del doc["truncated"]
    else:
        doc["truncated"] = truncated
    _refused(doc)


def test_an_over_size_namespace_answer_is_refused_and_one_at_the_bound_read():
    head = json.dumps(namespace_doc([], port=1)).encode()
    at_bound = head + b" " * (validate.MAX_DOCUMENT_BYTES - len(head))
    assert validate.peer_namespace(at_bound)["node"] == FAKE
    _refused(at_bound + b" ")


def test_a_namespace_signature_is_checked_against_target_body_and_secret():
    target, body = namespace_target(), b'{"format": "ckptfs-peer-namespace"}'
    name, sig = sign_response(SECRET, target, body)
    assert name == H_SIG and len(sig) == 64
    assert check_response(SECRET, target, body, sig)
    assert not check_response(SECRET, target, body + b" ", sig)          # tampered body
    assert not check_response(SECRET, target, body.replace(b"peer", b"Peer"), sig)
    assert not check_response(SECRET, namespace_target(), body, sig)     # another request
    assert not check_response(b"another-secret-of-32-bytes-00000", target, body, sig)
    other = sign_response(b"another-secret-of-32-bytes-00000", target, body)[1]
    assert not check_response(SECRET, target, body, other)
    for bad in (None, b"", sig[:63], sig + b"0", sig.upper(), b"\xff" * 64, b"z" * 64,
                sig[:32]):
        assert not check_response(SECRET, target, body, bad), bad
    assert namespace_target() != namespace_target()  # a fresh nonce per request


def _offer_file(size: int, crcs: object) -> bytes:
    return json.dumps({"format": "ckptfs-replica-offer", "version": 1, "origin": ORIGIN,
                       "generation": 1, "seq": 3, "path": "run/s", "kind": "dir",
                       "committed_ns": 1, "reason": "rename",
                       "endpoint": {"host": "127.0.0.1", "port": 9},
                       "files": [{"rel": "f", "size": size, "mode": 0o644, "crcs": crcs}],
                       "dirs": [], "symlinks": []}).encode()


@pytest.mark.parametrize(("size", "crcs"), [
    (0, [0]), (1, []), (1, [1, 2]), (CHUNK, [1, 2]), (CHUNK + 1, [1]), (CHUNK + 1, [1, 2, 3]),
    (9 << 20, [1, 2])])
def test_replica_crcs_of_the_wrong_count_are_refused(size, crcs):
    with pytest.raises(validate.DocumentError, match="crcs"):
        validate.replica_offer(_offer_file(size, crcs))


@pytest.mark.parametrize("crcs", [[-1], [1 << 32], [True], ["1"], [1.0], "12", {"0": 1}])
def test_replica_crcs_out_of_range_or_not_integers_are_refused(crcs):
    with pytest.raises(validate.DocumentError, match="crcs"):
        validate.replica_offer(_offer_file(1, crcs))


@pytest.mark.parametrize(("size", "crcs"), [
    (0, []), (1, [0]), (CHUNK, [(1 << 32) - 1]), (CHUNK + 1, [5, 6]), (9 << 20, [1, 2, 3])])
def test_replica_crcs_of_the_right_count_and_range_are_kept(size, crcs):
    (f,) = validate.replica_offer(_offer_file(size, crcs))["files"]
    assert f["crcs"] == crcs and f["size"] == size


def test_a_replica_file_without_crcs_has_none_and_no_virtual_objects():
    doc = json.loads(_offer_file(5, None))
    del doc["files"][0]["crcs"]
    desc = validate.replica_offer(json.dumps(doc).encode())
    assert "crcs" not in desc["files"][0]
    assert virtual_objects(desc) is None  # an older daemon's replica: not served


@pytest.mark.parametrize("size", [0, 1, CHUNK, CHUNK + 1, 9 << 20])
def test_a_virtual_object_s_crc32c_is_its_file_s(size):
    data = os.urandom(size)
    desc = descriptor({"model.pt": data, "tail": data[:size // 3]}, seq=11)
    objs = virtual_objects(desc)
    assert objs is not None and len(objs) == 2
    for obj, content in zip(objs, (data, data[:size // 3]), strict=True):
        assert obj.crc32c == crc32c(content), size
        assert obj.size == obj.stored_size == len(content)
        assert list(obj.chunk_crcs or ()) == chunk_crcs(content)
        for i in range(-(-len(content) // CHUNK)):
            assert verify_chunk(obj, i, content[i * CHUNK:(i + 1) * CHUNK])
    assert [o.key for o in objs] == [f"data/{ORIGIN}/replica/11/0", f"data/{ORIGIN}/replica/11/1"]


def test_a_replica_manifest_is_a_manifest_a_store_could_hold():
    files = {"model.pt": os.urandom(CHUNK + 1), "sub/optim.pt": b"o" * 100, "empty": b""}
    desc = descriptor(files, path="run/step_4", seq=4)
    desc["dirs"] = [{"path": "sub", "mode": 0o755, "mtime_ns": 1}]
    m = mf.loads(mf.dumps(manifest_of(desc)))
    assert m["path"] == "run/step_4" and m["kind"] == "dir"
    assert m["commit"]["node"] == ORIGIN and m["commit"]["seq"] == 4
    assert m["total_bytes"] == sum(map(len, files.values()))
    got = {f["path"]: f for f in m["files"]}
    assert set(got) == set(files)
    for i, f in enumerate(desc["files"]):
        obj = got[f["rel"]]["object"]
        assert obj["key"] == f"data/{ORIGIN}/replica/4/{i}"
        assert obj["crc32c"] == crc32c(files[f["rel"]])
    one = descriptor({"": b"single"}, path="ckpt.pt", seq=5, kind="file")
    m = mf.loads(mf.dumps(manifest_of(one)))
    assert m["kind"] == "file" and m["files"][0]["object"]["key"] == f"data/{ORIGIN}/replica/5/0"


@pytest.mark.parametrize("text", [":80", "h:0", "h:65536", "h:x", "h:", "[::1", "a b:1",
                                  "a:1,", "", "h:\u0663", "\u00e9:1", ",".join(["h:1"] * 65)])
def test_a_bad_peer_seeds_list_is_a_config_error_naming_the_flag(text):
    # test_replicas.py mounts with one bad seed (exit 2); these are the other shapes
    from ckptfs.config import ConfigError, parse_peer_seeds

    with pytest.raises(ConfigError, match="--peer-seeds"):
        parse_peer_seeds(text)


def test_a_peer_seeds_list_is_read_as_hosts_and_ports():
    from ckptfs.config import parse_peer_seeds

    assert parse_peer_seeds("b.example:7000, 10.0.0.2:7001,[::1]:80") == (
        ("b.example", 7000), ("10.0.0.2", 7001), ("::1", 80))
