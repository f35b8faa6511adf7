"""A store that hangs is a store that failed (docs/ARCHITECTURE.md "Store deadlines",
docs/SEMANTICS.md "A store that does not answer").

  * the store layer: S3Store through the fault proxy in `blackhole` / `oneway` mode: every
    operation ends with DeadlineExceeded at its deadline, its thread abandoned (the limiter's
    tokens come back once botocore's own timeouts end the threads); RetryingStore asks a black
    hole at most `deadline_attempts` times; the proxy's held threads end at stop().

A mount through the proxy, where nothing a user or a trainer calls waits on the hung store:
tests/mount/test_hang_mount.py; a fresh node reading a lost node's sets from its buddy meanwhile:
tests/multinode/test_hang_multinode.py.
"""

from __future__ import annotations

import time

import boto3
import botocore.config
import pytest
import trio

from cachemgr.store import DeadlineExceeded, RetryingStore, RetryPolicy, StoreError
from cachemgr.store.s3 import Deadlines, S3Options, S3Store
from tests.faultproxy import FaultProxy, Rule

# Short deadlines for the store-layer tests: what is checked is that they hold, not their
# production values (Deadlines' docstring argues those).
SHORT = Deadlines(base=1.0, control=1.0, list_page=1.0, complete=1.0, queue=2.0)


@pytest.fixture
def hole(s3_bucket):
    """(proxy, S3Store through it with SHORT deadlines and 2-connection pool, bucket)."""
    endpoint, bucket = s3_bucket
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                 config=botocore.config.Config(s3={"addressing_style": "path"})).put_object(
        Bucket=bucket, Key="p/data/x", Body=b"x" * 1000)
    proxy = FaultProxy(endpoint, seed=1).start()
    store = S3Store(f"s3://{bucket}/p", S3Options(
        endpoint_url=proxy.url, region="us-east-1", path_style=True, max_connections=2,
        connect_timeout=2, read_timeout=3, deadlines=SHORT))
    try:
        yield proxy, store, bucket
    finally:
        proxy.stop()


def _timed(fn) -> tuple[BaseException | None, float]:
    t0 = time.monotonic()
    try:
        trio.run(fn)
    except BaseException as e:  # noqa: BLE001 - the test judges it
        return e, time.monotonic() - t0
    return None, time.monotonic() - t0


@pytest.mark.parametrize("mode", ["blackhole", "oneway"])
def test_every_store_call_ends_at_its_deadline_in_a_black_hole(hole, mode):
    proxy, store, _ = hole
    proxy.set_rules([Rule(mode)])
    calls = {
        "get": lambda: store.get("data/x", 0, 10),
        "get_whole": lambda: store.get("data/x"),
        "head": lambda: store.head("data/x"),
        "list": lambda: store.list("data/"),
        "put": lambda: store._put("data/y", b"y" * 100, {}),
        "delete": lambda: store.delete("data/y"),
        "create_multipart": lambda: store.create_multipart("data/z"),
    }
    took: dict[str, float] = {}

    async def main():
        # one run: an abandoned thread's token is released in the run that started it
        for name, call in calls.items():
            t0 = time.monotonic()
            with pytest.raises(DeadlineExceeded) as e:
                await call()
            took[name] = s = round(time.monotonic() - t0, 2)
            assert "no answer within" in str(e.value) or "no connection free" in str(e.value)
            # the deadline (1 s + the bytes at 4 MiB/s), or the wait for a connection (2 s)
            # once both are held by abandoned threads, plus slack for a loaded machine
            assert s < 6, (name, s)
        assert proxy.hung() >= 1
        # abandoned threads end by botocore's timeouts (connect 2 s + read 3 s) and give their
        # tokens back; unhang() (the held connections closed) makes it sooner
        proxy.clear()
        with trio.fail_after(10):
            while store._limiter.borrowed_tokens:
                await trio.sleep(0.05)
        assert (await store.get("data/x", 0, 3)) == b"xxx"
    trio.run(main)
    print(f"{mode}: each call's time to DeadlineExceeded (s):", took)


def test_a_read_whole_gets_the_deadline_of_its_body_not_of_the_document_cap(hole):
    """A read of unknown length (a manifest, a part record) waits `base` for the answer's
    headers, then its body's size at the floor rate: through a black hole it ends at `base`
    (here 1 s; the 64 MiB cap at 4 MiB/s would have been 17 s); through a store whose body
    trickles out over 3 s, past `base`, it grows to its body (1 s + 1,000 bytes at 100 B/s)
    and returns it (`S3Store._sized`, moved from the request's thread)."""
    proxy, store, _ = hole
    slow = S3Store(store.url, S3Options(
        endpoint_url=proxy.url, region="us-east-1", path_style=True, max_connections=2,
        connect_timeout=2, read_timeout=3,
        deadlines=Deadlines(base=1.0, floor_rate=100.0, control=1.0, list_page=1.0,
                            complete=1.0, queue=2.0)))

    async def main():
        proxy.set_rules([Rule("slow", delay=3.0)])
        assert await slow.get("data/x") == b"x" * 1000
        proxy.set_rules([Rule("blackhole")])
        with pytest.raises(DeadlineExceeded) as e:
            await slow.get("data/x")
        assert "no answer within 1s" in str(e.value), e.value
        proxy.clear()
    trio.run(main)


def test_retrying_store_asks_a_black_hole_twice(hole):
    proxy, store, _ = hole
    proxy.set_rules([Rule("blackhole", ops={"head"})])
    r = RetryingStore(store, RetryPolicy(attempts=8, base_delay=0.01))

    async def head():
        await r.head("data/x")
    err, s = _timed(head)
    assert isinstance(err, DeadlineExceeded) and isinstance(err, StoreError)
    assert r.stats.retries == 1, r.stats
    assert s < 2 * SHORT.control + 3, s
    print(f"RetryingStore head in a black hole: {s:.2f} s, {r.stats.retries} retry")


def test_a_cancelled_store_call_returns_at_once(hole):
    proxy, store, _ = hole
    proxy.set_rules([Rule("blackhole")])

    async def cancelled():
        with trio.move_on_after(0.3):
            await store.get("data/x", 0, 10)
    err, s = _timed(cancelled)
    assert err is None and s < 1.0, s


def test_the_proxy_s_held_threads_end_at_stop(s3_endpoint):
    import http.client
    import threading

    proxy = FaultProxy(s3_endpoint).start()
    proxy.set_rules([Rule("blackhole")])
    host, port = proxy.url[len("http://"):].split(":")
    conns = [http.client.HTTPConnection(host, int(port), timeout=30) for _ in range(3)]
    for c in conns:
        c.request("GET", "/b/k")
    assert proxy.wait_hung(3, timeout=10)
    before = {t.name for t in threading.enumerate()}
    proxy.stop()
    assert proxy.hung() == 0
    left = [t for t in threading.enumerate() if t.name in before and t.is_alive()
            and t.name.startswith("Thread-")]
    assert not [t for t in proxy._threads if t.is_alive()], left
    for c in conns:
        with pytest.raises((http.client.HTTPException, OSError)):
            c.getresponse()
        c.close()


# ----------------------------------------------------------------------------------------------
# the peer client: a peer or a listing that never answers holds no other fetch


def test_peer_client_neither_a_black_hole_peer_nor_a_hung_listing_holds_a_fetch():
    from cachemgr.peer.client import PeerClient
    from cachemgr.peer.proto import PeerConfig, PeerEndpoint
    from tests.peers_helpers import CS, _obj, _server

    data = bytes(range(256)) * (CS * 2 // 256)
    obj = _obj(data)
    srv = _server(data)
    hang_listing = trio.Event()
    took: dict[str, float] = {}

    async def main() -> None:
        async with trio.open_nursery() as n:
            n.start_soon(srv.run)
            # a black hole: takes connections, reads nothing, answers nothing
            hole = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
            held: list[trio.SocketStream] = []

            async def accept_forever() -> None:
                while True:
                    held.append(await hole.accept())
            n.start_soon(accept_forever)
            # the hole is named as the object's writer: rendezvous asks it first
            peers = [PeerEndpoint("srv", "127.0.0.1", hole.socket.getsockname()[1]),
                     PeerEndpoint("good", "127.0.0.1", srv.port)]

            async def live(stale: frozenset[str]) -> list[PeerEndpoint]:
                if hang_listing.is_set():
                    await trio.sleep_forever()  # a store that never answers the listing
                return peers

            cl = PeerClient(cfg=PeerConfig(secret=b"s3cret", header_timeout=1.0, max_asked=2),
                            node="me", live_peers=live)
            n.start_soon(cl.run)
            t0 = time.monotonic()
            with trio.fail_after(10):
                assert await cl.fetch(obj, 0) == data[:CS]
            assert cl.statistics().errors == {"stall": 1}
            took["first fetch, a black-hole peer among two"] = time.monotonic() - t0
            assert took["first fetch, a black-hole peer among two"] < 5
            # the listing is due again (the hole was cut off: its record is to be read again)
            # and hangs: it runs in the background (PeerClient.run), every fetch uses the last
            # list at once
            hang_listing.set()
            t0 = time.monotonic()
            with trio.fail_after(10):
                assert await cl.fetch(obj, 1) == data[CS:]
            await trio.sleep(0.2)  # the refresh has begun, and hangs
            t0 = time.monotonic()
            with trio.fail_after(10):
                assert await cl.fetch(obj, 1) == data[CS:]
            took["fetch while a listing hangs"] = time.monotonic() - t0
            assert took["fetch while a listing hangs"] < 5
            n.cancel_scope.cancel()

    trio.run(main)
    print("peer client (s):", {k: round(v, 2) for k, v in took.items()})
