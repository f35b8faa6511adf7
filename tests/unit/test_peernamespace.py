"""Sets from peers while the store is down (--peer-seeds, cachemgr.tiering.peernamespace;
docs/SEMANTICS.md "Replicated"): what a fresh node does with a peer's namespace answer.

First the documents on their own (no mount): the namespace answer (validate.peer_namespace),
its signature (peer.proto.check_response), a held replica's chunk CRCs (validate.replica_offer)
and the objects and manifest a buddy serves a replica as (replicate.virtual_objects,
replica_manifest). Then real mounts: a fresh node whose store is down (a FaultProxy outage in
front of moto) mounted with --allow-empty-namespace and, as its only seed, a fake peer (an h11
server in this file) that answers with another secret, with a manifest that escapes, with chunk
bytes failing their CRC32C, or stalls; each time the node shows only what it may, names the
peer in one warning line, and logs no traceback.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs, urlsplit

import h11
import pytest
from fakehttp import FakeHTTPServer, Request, send_head, send_response
from faultproxy import FaultProxy

import ckptfs
from cachemgr.format import manifest as mf
from cachemgr.format import validate
from cachemgr.format.decode import crc32c
from cachemgr.format.objects import verify_chunk
from cachemgr.peer.proto import H_SIG, ReplayCache, check_auth, check_response, sign_response
from cachemgr.tiering.replicaproto import NAMESPACE_ROUTE, namespace_target
from cachemgr.tiering.replicate import replica_manifest, virtual_objects

SECRET = b"peerspace-secret-for-tests-01234"
CHUNK = validate.REPLICA_CHUNK
ORIGIN = "lostnode"   # the node whose replicas the fake peer holds (never mounted)
FAKE = "fakepeer"     # the fake peer's node id


# ----------------------------------------------------------------------------------------------
# documents: a held replica's descriptor, the manifest a buddy builds from it, a namespace answer


def chunk_crcs(data: bytes) -> list[int]:
    return [crc32c(data[i:i + CHUNK]) for i in range(0, len(data), CHUNK)]


def descriptor(files: dict[str, bytes], *, path: str = "run/step_9", seq: int = 7,
               origin: str = ORIGIN, kind: str = "dir",
               committed_ns: int | None = None) -> dict[str, Any]:
    """A held replica's descriptor as the buddy seals it (validate.replica_offer's fields, each
    file with the CRC32Cs of its REPLICA_CHUNKs), validated."""
    doc = {"format": "ckptfs-replica-offer", "version": 1, "origin": origin, "generation": 1,
           "seq": seq, "path": path, "kind": kind,
           "committed_ns": time.time_ns() if committed_ns is None else committed_ns,
           "reason": "rename", "endpoint": {"host": "127.0.0.1", "port": 9},
           "files": [{"rel": rel, "size": len(data), "mode": 0o644, "mtime_ns": 1,
                      "crcs": chunk_crcs(data)} for rel, data in files.items()],
           "dirs": [], "symlinks": []}
    return validate.replica_offer(json.dumps(doc).encode(),
                                  max_bytes=validate.MAX_DOCUMENT_BYTES)


def manifest_of(desc: dict[str, Any]) -> dict[str, Any]:
    objs = virtual_objects(desc)
    assert objs is not None
    return replica_manifest(desc, objs)


def served(desc: dict[str, Any], files: dict[str, bytes]) -> dict[str, bytes]:
    """The virtual object key -> file bytes the fake peer serves for replica `desc`."""
    objs = virtual_objects(desc)
    assert objs is not None
    return {o.key: files[f["rel"]] for f, o in zip(desc["files"], objs, strict=True)}


def namespace_doc(sets: list[str], *, port: int, **over: Any) -> dict[str, Any]:
    doc = {"format": "ckptfs-peer-namespace", "version": 1, "node": FAKE,
           "peers": [{"node": FAKE, "host": "127.0.0.1", "port": port}], "sets": sets,
           "truncated": False}
    doc.update(over)
    return doc


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


# ----------------------------------------------------------------------------------------------
# B. a fresh node, its store down, and a fake peer as its only seed


Reply = tuple[int, list[tuple[str, str]], bytes]


class FakePeer(FakeHTTPServer):
    """A threaded h11 server playing a buddy that holds replicas: GET /v1/replica/namespace is
    answered by `namespace(target, port)` (`port` its own; None: headers of a body that never
    comes), GET /v1/chunk
    from `objects` (virtual key -> file bytes; `corrupt`: every byte flipped). Every request's
    authentication is checked and recorded (`requests`: (target, why refused or None))."""

    def __init__(self, namespace: Callable[[str, int], Reply | None],
                 objects: dict[str, bytes] | None = None, corrupt: bool = False) -> None:
        self.namespace, self.objects, self.corrupt = namespace, objects or {}, corrupt
        self.requests: list[tuple[str, str | None]] = []
        self._replay = ReplayCache()
        self._lock = threading.Lock()  # guards `requests` and `_replay` (one thread per conn)
        super().__init__()

    def targets(self, route: str) -> list[str]:
        with self._lock:
            return [t for t, _ in self.requests if urlsplit(t).path == route]

    def handle(self, s: socket.socket, conn: h11.Connection) -> None:
        try:
            super().handle(s, conn)
        except (OSError, h11.ProtocolError):
            return  # the client went away

    def answer(self, s: socket.socket, conn: h11.Connection, req: Request) -> None:
        with self._lock:
            why = check_auth(SECRET, self._replay, req.method, req.target, req.headers)
            self.requests.append((req.target, why))
        reply = self._reply(req.target) if why is None else (401, [], b"")
        if reply is None:  # a stalled answer: headers, a few bytes, then nothing
            send_head(s, conn, 200, 100000, first=b'{"fo')
            self.stop.wait()
            return
        status, headers, body = reply
        send_response(s, conn, status, headers, body)

    def _reply(self, target: str) -> Reply | None:
        parts = urlsplit(target)
        if parts.path == NAMESPACE_ROUTE:
            return self.namespace(target, self.port)
        q = parse_qs(parts.query)
        data = self.objects.get(q.get("key", [""])[0])
        if parts.path != "/v1/chunk" or data is None:
            return 404, [], b"not held"
        i = int(q["i"][0])
        chunk = data[i * CHUNK:(i + 1) * CHUNK]
        if self.corrupt:
            chunk = bytes(b ^ 0xFF for b in chunk)
        return 200, [], chunk

    def refused(self) -> list[tuple[str, str | None]]:
        """The requests whose authentication failed, with why."""
        with self._lock:
            return [r for r in self.requests if r[1] is not None]


def signed(sets: list[str], secret: bytes = SECRET) -> Callable[[str, int], Reply]:
    """A namespace answer holding `sets` (manifest JSON), signed with `secret` for the
    request it answers."""
    def answer(target: str, port: int) -> Reply:
        body = json.dumps(namespace_doc(sets, port=port)).encode()
        name, sig = sign_response(secret, target, body)
        return 200, [(name.decode(), sig.decode()), ("content-type", "application/json")], body
    return answer


@pytest.fixture
def fresh(mount_factory, s3_bucket, tmp_path):
    """fresh(peer) -> a node mounted with --peers, --allow-empty-namespace and `peer` as its
    only --peer-seeds, its store (moto behind a FaultProxy) down from before the mount."""
    endpoint, bucket = s3_bucket
    proxy = FaultProxy(endpoint).start()
    proxy.outage()  # until the teardown: the node never lists the store
    made: list[Any] = []
    peers: list[FakePeer] = []

    def node(peer: FakePeer):
        peers.append(peer)
        sf = tmp_path / "c.secret"
        sf.write_bytes(SECRET)
        sf.chmod(0o600)
        m = mount_factory("c")
        made.append(m)
        m.start("--store", f"s3://{bucket}/p", "--s3-endpoint", proxy.url, "--s3-path-style",
                "--refresh-interval", "1", "--peers", "--peer-address", "127.0.0.1",
                "--peer-secret-file", str(sf), "--peer-seeds", peer.address,
                "--allow-empty-namespace")
        return m

    try:
        yield node
    finally:
        try:
            for m in made:
                errors = m.unexpected_errors()
                assert not errors, "the daemon logged unexpected errors:\n" + "\n".join(errors)
                assert SECRET.decode() not in m.log_text(), "the secret was logged"
        finally:
            proxy.clear()
            for m in made:
                m.cleanup()
            for p in peers:
                p.close()
            proxy.stop()


def sets_of(m) -> dict[str, dict[str, Any]]:
    return {s["path"]: s for s in ckptfs.status(m.path)["tiering"]["sets"]
            if s["state"] not in ("deleted", "replaced")}


def warned_about(m, peer: FakePeer) -> list[str]:
    """The daemon's warning lines naming the fake peer's address."""
    return [ln for ln in m.log_text().splitlines()
            if " WARNING " in ln and peer.address in ln]


def assert_asked_signed(peer: FakePeer) -> None:
    asked = peer.targets(NAMESPACE_ROUTE)
    assert asked, "the seed was never asked for its replicas"
    assert not peer.refused(), peer.refused()
    assert len(set(asked)) == len(asked), "a namespace request target was used twice"


def test_an_answer_signed_with_another_secret_shows_nothing(fresh):
    """The seed answers with a sound manifest signed with another secret: nothing shown, no
    chunk asked for, one warning naming the seed."""
    files = {"model.pt": b"m" * 1000}
    desc = descriptor(files)
    peer = FakePeer(signed([mf.dumps(manifest_of(desc)).decode()],
                           secret=b"another-secret-of-32-bytes-00000"), served(desc, files))
    c = fresh(peer)
    assert_asked_signed(peer)
    assert sets_of(c) == {}
    assert not (c.path / "run").exists()
    (line,) = warned_about(c, peer)
    assert "fails its signature" in line, line
    ns = ckptfs.status(c.path)["tiering"]["peers"]["namespace"]
    assert ns["refused"] >= 1 and ns["answered"] == 0 and ns["shown_sets"] == 0, ns
    assert not peer.targets("/v1/chunk")


@pytest.mark.parametrize("bad", ["path_escape", "foreign_key"])
def test_an_escaping_manifest_is_skipped_and_its_sound_neighbour_shown(fresh, bad):
    """A signed answer holding a manifest that escapes the mount (path "../evil") or names
    an object outside data/<its commit node>/, then a sound one: the first skipped (one
    warning), the second shown "replicated" and read bit-exact from the seed."""
    good_files = {"model.pt": os.urandom(CHUNK + 1000), "meta.json": b'{"step": 9}'}
    good = descriptor(good_files, path="run/good", seq=8)
    evil_files = {"model.pt": b"evil" * 100}
    evil_desc = descriptor(evil_files, path="run/bad", seq=9)
    evil = manifest_of(evil_desc)
    if bad == "path_escape":
        evil["path"] = "../evil"
    else:  # an object outside data/<the commit's node>/
        evil["files"][0]["object"]["key"] = f"data/{FAKE}/replica/9/0"
    peer = FakePeer(signed([json.dumps(evil), mf.dumps(manifest_of(good)).decode()]),
                    {**served(good, good_files), **served(evil_desc, evil_files),
                     f"data/{FAKE}/replica/9/0": evil_files["model.pt"]})
    c = fresh(peer)
    assert_asked_signed(peer)
    rows = sets_of(c)
    assert set(rows) == {"run/good"}, rows
    assert rows["run/good"]["state"] == "replicated", rows
    assert sorted(os.listdir(c.path / "run")) == ["good"]
    assert not (c.path.parent / "evil").exists() and not (c.cache_dir.parent / "evil").exists()
    (line,) = warned_about(c, peer)
    assert "invalid manifest" in line and "skipped" in line, line
    for rel, data in good_files.items():  # read from the fake peer, checked, bit-exact
        assert (c.path / "run" / "good" / rel).read_bytes() == data, rel
    asked = peer.targets("/v1/chunk")
    assert asked and all(t.startswith(f"/v1/chunk?key=data%2F{ORIGIN}%2Freplica%2F8%2F")
                         for t in asked), asked


def test_chunk_bytes_failing_their_crc_give_eio_and_are_not_kept(fresh):
    """A sound, signed manifest whose chunks the seed serves corrupt (the store down too):
    reads fail with EIO, again on a second read (nothing kept), the daemon serves on."""
    files = {"model.pt": os.urandom(CHUNK + 4096)}
    desc = descriptor(files, path="run/step_5", seq=5)
    peer = FakePeer(signed([mf.dumps(manifest_of(desc)).decode()]), served(desc, files),
                    corrupt=True)
    c = fresh(peer)
    rows = sets_of(c)
    assert rows["run/step_5"]["state"] == "replicated", rows
    target = c.path / "run" / "step_5" / "model.pt"
    assert target.stat().st_size == len(files["model.pt"])
    for _ in range(2):  # the second read finds nothing kept from the first: EIO again
        with pytest.raises(OSError) as e, open(target, "rb") as f:
            got = f.read()
            pytest.fail(f"read {len(got)} bytes of a file no source holds verified")
        assert e.value.errno == errno.EIO, e.value
    with pytest.raises(OSError) as e, open(target, "rb") as f:
        f.seek(CHUNK)
        f.read(100)
    assert e.value.errno == errno.EIO, e.value
    assert peer.targets("/v1/chunk"), "the fake peer was never asked for a chunk"
    (line,) = warned_about(c, peer)
    assert "fail its CRC32C" in line, line
    bad = bytes(b ^ 0xFF for b in files["model.pt"][:4096])
    for p in c.cache_dir.rglob("*"):  # no cache file holds the bad bytes
        if p.is_file() and p.stat().st_size >= 4096 and "replicas" not in p.parts:
            with open(p, "rb") as f:
                assert bad not in f.read(), p
    st = ckptfs.status(c.path)["tiering"]  # the daemon serves on
    assert st["sets"] and st["peers"]["client"]["errors"].get("corrupt", 0) >= 1, st["peers"]
    assert os.listdir(c.path / "run") == ["step_5"]


def test_a_stalled_namespace_answer_does_not_hold_the_mount(fresh):
    """The seed sends headers and a few body bytes, then nothing: the mount comes up (within
    the client's body budget), showing no sets, and names the seed once."""
    peer = FakePeer(lambda target, port: None)
    c = fresh(peer)
    assert ckptfs.status(c.path)["tiering"]["sets"] == []
    assert os.listdir(c.path) == []
    assert_asked_signed(peer)
    (line,) = warned_about(c, peer)
    assert "its replicas are not shown" in line, line


def test_an_answer_whose_set_is_not_valid_text_is_refused_whole(fresh):
    """A signed answer whose set string holds a lone surrogate (valid JSON, not valid text):
    refused as an invalid answer, its sound manifest with it; the mount comes up (it once
    failed: validate.peer_namespace raised UnicodeEncodeError)."""
    files = {"model.pt": b"m" * 1000}
    desc = descriptor(files)
    good = mf.dumps(manifest_of(desc)).decode()

    def answer(target: str, port: int) -> Reply:
        body = json.dumps(namespace_doc([good, "\ud800"], port=port)).encode()
        assert b"\\ud800" in body
        name, sig = sign_response(SECRET, target, body)
        return 200, [(name.decode(), sig.decode())], body

    peer = FakePeer(answer, served(desc, files))
    c = fresh(peer)
    assert_asked_signed(peer)
    assert sets_of(c) == {}
    (line,) = warned_about(c, peer)
    assert "invalid namespace answer" in line and "not valid text" in line, line
    assert not peer.targets("/v1/chunk")
