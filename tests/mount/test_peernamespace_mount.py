"""Sets from peers while the store is down (--peer-seeds, cachemgr.tiering.peernamespace;
docs/SEMANTICS.md "Replicated"): what a fresh node does with a peer's namespace answer, through
real mounts (the documents on their own: tests/unit/test_peernamespace.py).

A fresh node whose store is down (a FaultProxy outage in front of moto) mounted with
--allow-empty-namespace and, as its only seed, a fake peer (an h11 server in this file) that
answers with another secret, with a manifest that escapes, with chunk bytes failing their
CRC32C, or stalls; each time the node shows only what it may, names the peer in one warning line,
and logs no traceback.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs, urlsplit

import h11
import pytest

import ckptfs
from cachemgr.format import manifest as mf
from cachemgr.peer.proto import ReplayCache, check_auth, sign_response
from cachemgr.tiering.replicaproto import NAMESPACE_ROUTE
from cachemgr.tiering.replicate import virtual_objects
from tests.fakehttp import FakeHTTPServer, Request, send_head, send_response
from tests.faultproxy import FaultProxy
from tests.peernamespace_helpers import (
    CHUNK,
    FAKE,
    ORIGIN,
    SECRET,
    descriptor,
    manifest_of,
    namespace_doc,
)


def served(desc: dict[str, Any], files: dict[str, bytes]) -> dict[str, bytes]:
    """The virtual object key -> file bytes the fake peer serves for replica `desc`."""
    objs = virtual_objects(desc)
    assert objs is not None
    return {o.key: files[f["rel"]] for f, o in zip(desc["files"], objs, strict=True)}


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
