"""Restore from peers (--peers, docs/ARCHITECTURE.md "Peers"): real mounts on 127.0.0.1 on one
moto S3 store. A node reading a set it does not hold gets its chunks from the live nodes that
hold them (the writer, nodes that restored it), every chunk checked against the manifest's
CRC32C; with the peers gone, from the store. Misbehaving peers (a wrong secret, corrupt bytes,
a stalled body) are cut off, named in the log, and change nothing on the node: the data is
bit-exact from the store, and nothing is written outside the cache dir.

The fake peers are tiny h11 servers in this process that register a member record with their
endpoint in the store, as a real node does (cachemgr.tiering.members).
"""

from __future__ import annotations

import io
import json
import os
import socket
import time

import h11
import pytest

torch = pytest.importorskip("torch")
import ckptfs
from tests.conftest import run_cli, wait_for
from tests.fakehttp import FakeHTTPServer, Request, request, send_head, send_response

MiB = 1 << 20
SECRET = b"peer-secret-for-tests-0123456789"


@pytest.fixture
def cluster(mount_factory, s3_bucket, tmp_path):
    """cluster(name, *extra, secret=SECRET) -> a started node with --peers on the bucket."""
    endpoint, bucket = s3_bucket
    made = []

    def node(name: str, *extra: str, secret: bytes = SECRET, peers: bool = True):
        sf = tmp_path / f"{name}.secret"
        sf.write_bytes(secret)
        sf.chmod(0o600)
        m = mount_factory(name)
        peer = ["--peers", "--peer-address", "127.0.0.1", "--peer-secret-file", str(sf)] \
            if peers else []
        m.start("--store", f"s3://{bucket}/p", "--s3-endpoint", endpoint, "--s3-path-style",
                "--refresh-interval", "1", "--part-size", "5M", *peer, *extra)
        m.node_id = ckptfs.status(m.path)["tiering"]["store"]["node"]
        made.append(m)
        return m

    node.endpoint, node.bucket = endpoint, bucket
    yield node
    for m in made:
        errors = m.unexpected_errors()
        assert not errors, f"daemon {m.mountpoint.name} logged unexpected errors:\n" + \
            "\n".join(errors)
        assert SECRET.decode() not in m.log_text(), "the secret was logged"


def node_id(m) -> str:
    return m.node_id


def peers_status(m) -> dict:
    return ckptfs.status(m.path)["tiering"]["peers"]


def write_checkpoint(m, rel: str = "run/step_1", seed: int = 1) -> bytes:
    """A torch.save checkpoint of ~24 MiB (6 chunks), renamed into place and durable."""
    g = torch.Generator().manual_seed(seed)
    state = {"w": torch.randn(6 * 1024 * 1024 - 4096, generator=g),
             "b": torch.arange(1000, dtype=torch.int64)}
    tmp = m.path / f"{rel}.tmp"
    tmp.mkdir(parents=True)
    torch.save(state, tmp / "model.pt")
    os.rename(tmp, m.path / rel)
    ckptfs.wait_durable(m.path / rel, timeout=120)
    return (m.path / rel / "model.pt").read_bytes()


def read_on(m, rel: str = "run/step_1") -> bytes:
    p = m.path / rel / "model.pt"
    wait_for(p.exists, timeout=30, what=f"{rel} on {m.mountpoint.name}")
    data = p.read_bytes()
    torch.load(io.BytesIO(data), weights_only=True)  # it loads
    return data


def from_peers(m) -> tuple[int, int]:
    s = peers_status(m)
    return s["restored_from_peers"]["bytes"], s["restored_from_store"]["bytes"]


def outside(m) -> dict[str, tuple[int, int]]:
    """(size, mtime) of every file of the test's directory outside `m`'s cache dir, mount
    points and log files."""
    root = m.cache_dir.parent
    out = {}
    for p in root.rglob("*"):
        if p.is_file() and "-cache" not in p.relative_to(root).parts[0] and \
                not p.name.endswith(".log") and "-mnt" not in p.relative_to(root).parts[0]:
            st = p.stat()
            out[str(p)] = (st.st_size, st.st_mtime_ns)
    return out


# ----------------------------------------------------------------------------------------------
# real nodes


@pytest.mark.parametrize("prefetch", ["auto", "set"])
def test_restore_from_peers_then_store_when_peers_gone(cluster, prefetch):
    a = cluster("a")
    data = write_checkpoint(a)
    b = cluster("b", "--prefetch", prefetch)
    assert read_on(b) == data
    c = cluster("c", "--prefetch", prefetch)
    assert read_on(c) == data
    peer_bytes, store_bytes = from_peers(c)
    assert peer_bytes >= 0.9 * len(data), (peer_bytes, store_bytes)
    assert peer_bytes + store_bytes >= len(data)
    served = sum(peers_status(n)["server"]["served_bytes"] for n in (a, b))
    assert served >= peer_bytes
    shown = run_cli("status", str(c.path)).stdout
    assert "from peers" in shown and "serving at 127.0.0.1:" in shown, shown
    st = peers_status(c)
    assert st["server"]["endpoint"].startswith("127.0.0.1:")
    assert st["client"]["cut_off"] == []

    # Every holder gone: D restores from the store, bit-exact, without a long wait for them.
    # A is killed (its member record stays, naming a port nobody listens on); B, C unmount.
    a.kill9()
    b.stop()
    c.stop()
    d = cluster("d", "--prefetch", prefetch)
    t0 = time.monotonic()
    assert read_on(d) == data
    assert time.monotonic() - t0 < 15
    peer_bytes, store_bytes = from_peers(d)
    assert peer_bytes == 0 and store_bytes >= len(data)
    assert [x["node"] for x in peers_status(d)["client"]["cut_off"]] == [node_id(a)]
    assert "is unreachable" in d.log_text()


def test_a_node_without_peers_is_unchanged(cluster):
    a = cluster("a", peers=False)
    data = write_checkpoint(a)
    assert ckptfs.status(a.path)["tiering"]["peers"] is None
    records = [k for k in _store_keys(cluster) if k.startswith("p/members/")]
    assert records
    for k in records:
        assert "peer" not in json.loads(_store_get(cluster, k))
    # a member record whose peer field is bad is ignored, with one log line
    doc = {"format": "ckptfs-member", "version": 1, "node": "badpeer", "lease_s": 600.0,
           "renewed_ns": time.time_ns(), "pid": 1, "generation": 1,
           "peer": {"host": "a host", "port": 0}}
    _s3(cluster).put_object(Bucket=cluster.bucket, Key="p/members/@badpeer.json",
                            Body=json.dumps(doc).encode())
    b = cluster("b")
    assert read_on(b) == data
    assert from_peers(b)[0] == 0  # A serves nothing
    said = [ln for ln in b.log_text().splitlines() if "member record of node badpeer" in ln]
    assert len(said) == 1 and "host" in said[0], said


# ----------------------------------------------------------------------------------------------
# fake peers


def _s3(cluster):
    import boto3

    return boto3.client("s3", endpoint_url=cluster.endpoint, region_name="us-east-1",
                        aws_access_key_id="testing", aws_secret_access_key="testing")


def _store_keys(cluster) -> list[str]:
    out = _s3(cluster).list_objects_v2(Bucket=cluster.bucket)
    return [o["Key"] for o in out.get("Contents", [])]


def _store_get(cluster, key: str) -> bytes:
    return _s3(cluster).get_object(Bucket=cluster.bucket, Key=key)["Body"].read()


class FakePeer(FakeHTTPServer):
    """An h11 server on 127.0.0.1 that answers every chunk request with `behaviour`:
    "corrupt" (the right size, wrong bytes), "stall" (headers, then no body), or it is asked
    with another secret (its 401s come from `secret`)."""

    timeout = 30.0

    def __init__(self, behaviour: str, real: bytes) -> None:
        self.behaviour = behaviour
        self.real = real       # the file's bytes: chunk i is real[i*4MiB:...]
        self.requests = 0
        super().__init__()

    def answer(self, s: socket.socket, conn: h11.Connection, req: Request) -> None:
        self.requests += 1
        i = int(req.query["i"][0])
        chunk = self.real[i * 4 * MiB:(i + 1) * 4 * MiB]
        if self.behaviour == "unauth":
            send_response(s, conn, 401)
            return
        if self.behaviour == "stall":
            send_head(s, conn, 200, len(chunk))
            self.stop.wait(30)
            return
        bad = bytes(b ^ 0xFF for b in chunk[:4096]) + chunk[4096:]
        send_response(s, conn, 200, body=bad)

    def register(self, cluster, node: str) -> str:
        """Its member record in the store, as a live node with --peers writes it."""
        key = f"p/members/@{node}.json"
        doc = {"format": "ckptfs-member", "version": 1, "node": node, "lease_s": 600.0,
               "renewed_ns": time.time_ns(), "pid": os.getpid(), "generation": 1,
               "peer": {"host": "127.0.0.1", "port": self.port}}
        _s3(cluster).put_object(Bucket=cluster.bucket, Key=key, Body=json.dumps(doc).encode())
        return key


@pytest.mark.parametrize("behaviour,said", [
    ("unauth", "refused our requests (401"),
    ("corrupt", "fail its CRC32C"),
    ("stall", "sent 0 of"),
])
def test_a_misbehaving_peer_is_cut_off_and_named(cluster, behaviour, said):
    a = cluster("a", peers=False)  # the writer serves nothing: only the fake peer is asked
    data = write_checkpoint(a)
    fake = FakePeer(behaviour, data)
    try:
        fake.register(cluster, "evil")
        c = cluster("c", "--prefetch", "none")
        before = outside(c)
        t0 = time.monotonic()
        assert read_on(c) == data
        took = time.monotonic() - t0
        assert took < 15, took
        assert fake.requests >= 1
        log = c.log_text()
        named = [ln for ln in log.splitlines() if f"peer evil at 127.0.0.1:{fake.port} " in ln]
        assert len(named) == 1 and said in named[0], log[-3000:]
        st = peers_status(c)
        assert [x["node"] for x in st["client"]["cut_off"]] == ["evil"]
        assert st["restored_from_peers"]["bytes"] == 0
        assert fake.requests == 1  # cut off: not asked again
        shown = run_cli("status", str(c.path))
        assert shown.returncode == 0 and f"cut off: evil at 127.0.0.1:{fake.port}" in \
            shown.stdout.replace("\n", " "), shown.stdout
        # nothing written outside the cache dir (but the log); no byte of the peer's in it
        assert outside(c) == before
        held = [p.read_bytes() for p in (c.cache_dir / "data").rglob("*") if p.is_file()]
        assert data in held
        bad = bytes(b ^ 0xFF for b in data[:4096])
        assert not any(bad in h for h in held)
    finally:
        fake.close()


# ----------------------------------------------------------------------------------------------
# the server refuses what is not authentic, and keeps serving


def test_server_refuses_bad_auth_and_keeps_serving(cluster):
    from cachemgr.peer.proto import chunk_target, sign

    a = cluster("a")
    data = write_checkpoint(a)
    port = int(peers_status(a)["server"]["endpoint"].rsplit(":", 1)[1])
    man = json.loads(_store_get(cluster, "p/manifests/run/step_1.json"))
    obj = man["files"][0]["object"]
    target = chunk_target(obj["key"], obj["crc32c"], 0)
    assert request(port, "GET", target) == 401
    assert request(port, "GET", target, sign(b"wrong secret", "GET", target)) == 401
    assert request(port, "GET", target, sign(SECRET, "GET", target, now=time.time() - 600)) == 401
    good = sign(SECRET, "GET", target)
    got = bytearray()
    assert request(port, "GET", target, good, into=got) == 200
    assert bytes(got) == data[:4 * MiB]
    assert request(port, "GET", target, good) == 401  # the same nonce again: a replay
    bad = target.replace("&i=0", "&i=x")
    assert request(port, "GET", bad, sign(SECRET, "GET", bad)) == 400
    other = chunk_target(obj["key"], obj["crc32c"] ^ 1, 0)
    assert request(port, "GET", other, sign(SECRET, "GET", other)) == 404
    last = chunk_target(obj["key"], obj["crc32c"], 5)  # a wrong CRC asked poisons nothing
    assert request(port, "GET", last, sign(SECRET, "GET", last)) == 200
    st = peers_status(a)["server"]
    assert st["refused_auth"] == 4 and st["served_chunks"] == 2
    assert (a.path / "run/step_1/model.pt").read_bytes() == data
