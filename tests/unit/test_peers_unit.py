"""The peer protocol in process, no mount (cachemgr.peer: proto, client, server): HMAC,
replay and clock checks, request bounds, rendezvous order, the member record's `peer` field,
--peer-secret-file checks; a real PeerServer on 127.0.0.1 against the real PeerClient."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import h11
import pytest
import trio

from cachemgr.format import validate
from cachemgr.format.decode import crc32c
from cachemgr.format.objects import StoredObject
from cachemgr.peer import server as peerserve
from cachemgr.peer.client import PeerClient
from cachemgr.peer.proto import (
    CLOCK_WINDOW_S,
    PeerConfig,
    PeerEndpoint,
    ReplayCache,
    check_auth,
    chunk_target,
    parse_chunk_target,
    rendezvous,
    sign,
    writer_of,
)
from ckptfs.config import ConfigError, load_peer_secret
from tests.peers_helpers import CS, SECRET, _obj, _server


def _headers(h: list[tuple[bytes, bytes]]) -> dict[bytes, bytes]:
    return dict(h)


def test_hmac_replay_and_clock():
    t = chunk_target("data/n1/4/1/model.pt", 123, 2)
    now = time.time()
    replay = ReplayCache()
    good = _headers(sign(SECRET, "GET", t, now))
    assert check_auth(SECRET, replay, "GET", t, good, now) is None
    assert check_auth(SECRET, replay, "GET", t, good, now) == "nonce replayed"
    assert "bad HMAC" in check_auth(SECRET, replay, "GET", t, _headers(
        sign(b"other", "GET", t, now)), now)
    # the MAC covers method, target, time and nonce: change any and it fails
    fresh = _headers(sign(SECRET, "GET", t, now))
    assert "bad HMAC" in check_auth(SECRET, replay, "PUT", t, fresh, now)
    assert "bad HMAC" in check_auth(SECRET, replay, "GET", t + "x", fresh, now)
    old = _headers(sign(SECRET, "GET", t, now - CLOCK_WINDOW_S - 5))
    assert "timestamp" in check_auth(SECRET, replay, "GET", t, old, now)
    assert check_auth(SECRET, replay, "GET", t, {}, now) == "no authentication headers"
    bad = {**fresh, b"x-ckptfs-nonce": b"zz"}
    assert check_auth(SECRET, replay, "GET", t, bad, now) == "malformed authentication headers"


def test_replay_cache_is_bounded_and_forgets_old_nonces():
    r = ReplayCache(window=60, limit=3)
    assert r.add("a", 0) and r.add("b", 1) and r.add("c", 2)
    assert not r.add("d", 3)  # full of nonces in the window: refused, not forgotten
    assert r.add("d", 200) and len(r) == 1  # the others left the window
    assert not r.add("d", 201)


def test_chunk_target_round_trip_and_bounds():
    key = "data/n1/4/1/a b%2F&c=d.pt"
    req = parse_chunk_target(chunk_target(key, 99, 7))
    assert req is not None and (req.key, req.crc, req.index) == (key, 99, 7)
    assert parse_chunk_target("/v1/chunk?key=k&crc=1") is None
    assert parse_chunk_target("/v1/chunk?key=k&crc=-1&i=0") is None
    assert parse_chunk_target("/v2/chunk?key=k&crc=1&i=0") is None
    assert parse_chunk_target(chunk_target("k" * 2000, 1, 0)) is None
    assert parse_chunk_target("/v1/chunk?key=k&crc=1&i=0&i=1") is None
    # more query fields than the transport parses (8): refused as malformed, not an exception
    # (which the server would count as an internal error, dropping the connection)
    many = "".join(f"&x{n}=1" for n in range(9))
    assert parse_chunk_target(f"/v1/chunk?key=k&crc=1&i=0{many}") is None
    from cachemgr.tiering.replicaproto import file_target, parse_file_target
    req_f = parse_file_target(file_target(3, 1, 0, 4096))
    assert req_f is not None and (req_f.seq, req_f.index, req_f.length) == (3, 1, 4096)
    assert parse_file_target(file_target(3, 1, 0, 4096) + many) is None


def test_rendezvous_is_stable_and_puts_the_writer_first():
    peers = [PeerEndpoint(f"n{i}", "127.0.0.1", 1000 + i) for i in range(20)]
    key = "data/n7/4/1/model.pt"
    order = rendezvous(key, peers, writer_of(key))
    assert order[0].node == "n7" and sorted(p.node for p in order) == sorted(
        p.node for p in peers)
    # others coming and going do not reorder the rest
    fewer = [p for p in peers if p.node not in ("n3", "n11")]
    assert [p.node for p in rendezvous(key, fewer, "n7")] == \
        [p.node for p in order if p.node not in ("n3", "n11")]
    # another file ranks the peers differently (load spreads)
    other = rendezvous("data/n7/5/1/other.pt", peers, None)
    assert [p.node for p in other] != [p.node for p in order[1:] + order[:1]]
    assert writer_of("manifests/x.json") is None


def test_member_record_peer_field_is_validated():
    assert validate.peer_endpoint({"host": "10.0.0.5", "port": 4711}) == ("10.0.0.5", 4711)
    for bad in ({"host": "h", "port": 0}, {"host": "h", "port": "80"}, {"host": "", "port": 1},
                {"host": "a/b", "port": 1}, {"host": "h", "port": 1, "x": 1}, ["h", 1],
                {"host": "h" * 300, "port": 1}, {"host": "h", "port": True}):
        with pytest.raises(validate.DocumentError):
            validate.peer_endpoint(bad)
    doc = (b'{"format": "ckptfs-member", "version": 1, "node": "n1", "lease_s": 5, '
           b'"generation": 1, "peer": {"host": "127.0.0.1", "port": 9}}')
    assert validate.protocol_doc(doc, "member")["peer"] == ("127.0.0.1", 9)
    no_peer = doc.replace(b', "peer": {"host": "127.0.0.1", "port": 9}', b"")
    assert validate.protocol_doc(no_peer, "member")["peer"] is None


def test_peer_secret_file_checks(tmp_path):
    f = tmp_path / "s"
    f.write_bytes(b"  abcdefghijklmnop\n")
    f.chmod(0o600)
    assert load_peer_secret(f) == b"abcdefghijklmnop"
    f.chmod(0o640)
    with pytest.raises(ConfigError, match="readable by group or others"):
        load_peer_secret(f)
    f.chmod(0o600)
    f.write_bytes(b"\n")
    with pytest.raises(ConfigError, match="empty"):
        load_peer_secret(f)
    f.write_bytes(b"short-secret\n")
    with pytest.raises(ConfigError, match="fewer than 16"):
        load_peer_secret(f)
    with pytest.raises(ConfigError, match="No such file"):
        load_peer_secret(tmp_path / "missing")


def test_mount_refuses_a_bad_secret_file_with_exit_2(tmp_path):
    f = tmp_path / "s"
    f.write_bytes(b"the-secret-value")
    f.chmod(0o644)
    (tmp_path / "mnt").mkdir()
    res = subprocess.run([sys.executable, "-m", "ckptfs", "mount", str(tmp_path / "mnt"),
                          "--cache-dir", str(tmp_path / "c"), "--peers",
                          "--peer-secret-file", str(f)], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 2, res
    assert res.stderr.count("\n") == 1 and "readable by group or others" in res.stderr
    assert "the-secret-value" not in res.stderr + res.stdout
    res = subprocess.run([sys.executable, "-m", "ckptfs", "mount", str(tmp_path / "mnt"),
                          "--cache-dir", str(tmp_path / "c"), "--peers"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--peer-secret-file" in res.stderr


# ----------------------------------------------------------------------------------------------
# a PeerServer and a PeerClient on 127.0.0.1


def _client(srv: peerserve.PeerServer, secret: bytes = SECRET) -> PeerClient:
    ep = PeerEndpoint("srv", "127.0.0.1", srv.port)

    async def live(stale: frozenset[str]) -> list[PeerEndpoint]:
        return [ep]

    return PeerClient(cfg=PeerConfig(secret=secret), node="me", live_peers=live)


def test_client_and_server_end_to_end():
    data = bytes(range(256)) * (CS * 3 // 256) + b"tail"
    obj = _obj(data)
    srv = _server(data)

    async def main() -> None:
        async with trio.open_nursery() as n:
            n.start_soon(srv.run)
            cl = _client(srv)
            got = [await cl.fetch(obj, i) for i in range(4)]
            assert b"".join(g or b"" for g in got) == data
            other = StoredObject(key="data/x/1/1/g", size=4, stored_size=4,
                                 crc32c=crc32c(b"abcd"), chunk_size=CS,
                                 chunk_crcs=(crc32c(b"abcd"),))
            assert await cl.fetch(other, 0) is None  # 404: not held there
            assert await cl.fetch(other, 0) is None  # remembered: not asked again
            st = cl.statistics()
            assert (st.hits, st.misses, st.cut_off) == (4, 1, [])
            # a target too long: 414; headers too long: 431; the server keeps serving
            status = await trio.to_thread.run_sync(_raw, srv.port, "/v1/chunk?" + "k" * 5000)
            assert status == 414
            status = await trio.to_thread.run_sync(_raw, srv.port, "/v1/chunk", "h" * 40000)
            assert status == 431
            bad = _client(srv, secret=b"wrong")
            assert await bad.fetch(obj, 0) is None
            assert bad.statistics().cut_off[0]["why"].startswith("refused our requests")
            assert await _client(srv).fetch(obj, 1) == data[CS:2 * CS]
            s = srv.statistics()
            assert (s.served_chunks, s.not_held, s.refused_auth, s.bad_requests) == (5, 1, 1, 2)
            n.cancel_scope.cancel()

    trio.run(main)


def test_client_cuts_off_a_peer_with_corrupt_bytes():
    data = bytes(range(256)) * (CS * 2 // 256)
    obj = _obj(data)
    srv = _server(data, tamper=True)

    async def main2() -> None:
        async with trio.open_nursery() as n:
            n.start_soon(srv.run)
            cl = _client(srv)
            assert await cl.fetch(obj, 0) is None
            assert await cl.fetch(obj, 1) is None
            st = cl.statistics()
            assert st.errors == {"corrupt": 1} and st.asked == 1  # cut off after the first
            n.cancel_scope.cancel()

    trio.run(main2)


def test_server_connection_limit_answers_busy():
    data = b"y" * CS
    srv = _server(data, max_connections=1)

    async def main() -> None:
        async with trio.open_nursery() as n:
            n.start_soon(srv.run)
            hold = await trio.open_tcp_stream("127.0.0.1", srv.port)  # idle: holds the slot
            await trio.sleep(0)
            status = await trio.to_thread.run_sync(_raw, srv.port, "/v1/chunk")
            assert status == 503 and srv.statistics().busy == 1
            await hold.aclose()
            n.cancel_scope.cancel()

    trio.run(main)


def _raw(port: int, target: str, header: str = "") -> int:
    conn = h11.Connection(h11.CLIENT)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        extra = f"x-big: {header}\r\n" if header else ""
        s.sendall(f"GET {target} HTTP/1.1\r\nhost: x\r\n{extra}\r\n".encode())
        while True:
            ev = conn.next_event()
            if ev is h11.NEED_DATA:
                conn.receive_data(s.recv(65536))
                continue
            assert isinstance(ev, h11.Response), ev
            return ev.status_code


def test_object_key_lookup_uses_its_index_also_in_a_cache_made_before_it(tmp_path):
    """The peer server's look-up by object key (Index.inos_of_object) is an index search, not a
    scan of every inode; a cache whose index predates it gets it at the next open."""
    from cachemgr.core.index import Index

    path = tmp_path / "index.sqlite"
    index = Index.open(path, uid=0, gid=0)
    query = ("EXPLAIN QUERY PLAN SELECT ino FROM inodes WHERE obj IS NOT NULL AND "
             "json_extract(obj, '$.key') = ? LIMIT ?")

    def plan(ix: Index) -> str:
        # a text of its own each time: the sqlite3 module's statement cache would hand back
        # the EXPLAIN prepared before the DROP INDEX below, with the old plan in it
        plan.n = getattr(plan, "n", 0) + 1
        rows = ix.conn.execute(f"{query} -- {plan.n}", ("k", 4)).fetchall()
        return " ".join(str(r[-1]) for r in rows)

    assert "USING INDEX inodes_by_obj_key" in plan(index)
    index.conn.execute("UPDATE inodes SET obj = ? WHERE ino = 1", ('{"key": "data/n/1"}',))
    assert index.inos_of_object("data/n/1") == [1] and index.inos_of_object("data/n/2") == []
    index.conn.execute("DROP INDEX inodes_by_obj_key")   # as a cache made before it was
    assert "SCAN inodes" in plan(index)
    index.conn.close()
    again = Index.open(path, uid=0, gid=0)
    assert "USING INDEX inodes_by_obj_key" in plan(again)
    assert again.inos_of_object("data/n/1") == [1]
    again.conn.close()
