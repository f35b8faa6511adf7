"""Fast unit tests of the multi-node pieces that need no mount: part record keys and parsing,
member/intent/ack keys, and reading a DCP `.metadata` without torch (real DCP output, and
hostile pickles that must run nothing)."""

from __future__ import annotations

import json
import os
import pickle

import pytest

from cachemgr.format.dcp import storage_files
from cachemgr.tiering import lease as lease_record
from cachemgr.tiering import members, parts

torch = pytest.importorskip("torch")
import torch.distributed.checkpoint as dcp

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def test_part_keys_round_trip():
    for d in ("ckpt/step_1", "a/b/c.tmp", "x", "dir with space/ünï"):
        key = parts.part_key(d, "6d60a523")
        assert key.startswith(parts.records_prefix(d))
        assert parts.parse_key(key) == (d, "6d60a523")
    # A directory named like a record is still a directory: only the last component counts.
    key = parts.part_key("ckpt/@x.json", "aa")
    assert parts.parse_key(key) == ("ckpt/@x.json", "aa")
    for bad in ("parts/@n.json", "parts/d/n.json", "manifests/d/@n.json", "parts/d/@n.txt"):
        assert parts.parse_key(bad) is None, bad


def test_member_intent_and_ack_keys_round_trip():
    assert members.parse_member_key(lease_record.member_key("6d60a523")) == "6d60a523"
    iid = "6d60a523-17-18a3c0de5f2b1c00"
    assert members.parse_intent_key(members.intent_key(iid)) == iid
    key = members.ack_key(iid, "a41be007")
    assert key.startswith(members.acks_prefix(iid))
    assert members.parse_ack_key(key) == (iid, "a41be007")
    for bad in ("members/6d60a523.json", "members/x/@n.json", "parts/d/@n.json"):
        assert members.parse_member_key(bad) is None, bad
    for bad in ("intents/a-1.json", "intents/a-1-2/x.json", "intents/a-1-2.txt"):
        assert members.parse_intent_key(bad) is None, bad
    for bad in ("acks/a-1-2/n.json", "acks/@n.json", "acks/a-1-2/@n/x.json"):
        assert members.parse_ack_key(bad) is None, bad


def test_part_record_validation():
    rec = parts.build("n1", "ckpt/s", [{"name": "f", "size": 3, "mode": 0o640, "mtime_ns": 1,
                                        "object": None}])
    assert parts.loads(json.dumps(rec).encode()) == rec
    for bad in (b"not json", b'{"format": "other"}', b'{"format": "ckptfs-part", "version": 9}',
                b'{"format": "ckptfs-part", "version": 1, "files": [{"name": "f"}]}'):
        with pytest.raises(parts.PartError):
            parts.loads(bad)


def test_dcp_metadata_storage_files_from_real_saves(tmp_path):
    sd = {"a": torch.zeros(10), "b": {"c": torch.ones(3, dtype=torch.bfloat16)}, "n": 3,
          "big": torch.randn(300, 300)}
    dcp.save(sd, checkpoint_id=str(tmp_path / "one"))
    names = {p for p in os.listdir(tmp_path / "one") if p.endswith(".distcp")}
    got = storage_files((tmp_path / "one" / ".metadata").read_bytes())
    assert got == names and got
    # Several storage files per rank (thread_count): every one is named.
    writer = dcp.FileSystemWriter(str(tmp_path / "many"), thread_count=3)
    dcp.save(sd, storage_writer=writer)
    names = {p for p in os.listdir(tmp_path / "many") if p.endswith(".distcp")}
    assert len(names) > 1
    assert storage_files((tmp_path / "many" / ".metadata").read_bytes()) == names


class _Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_dcp_metadata_reader_runs_nothing_from_the_file(tmp_path):
    marker = tmp_path / "pwned"
    assert storage_files(pickle.dumps(_Evil(marker))) is None
    assert storage_files(pickle.dumps({"storage_data": _Evil(marker)})) is None
    assert not marker.exists()
    for junk in (b"", b"garbage", pickle.dumps([1, 2, 3])[:-3]):
        assert storage_files(junk) is None


def test_an_ack_that_lands_after_its_intent_went_is_taken_back(tmp_path):
    """The committer deletes its intent, then lists and deletes the acks (drop_intent). An ack
    PUT after that listing would stay in the store for good: the acknowledging node checks the
    intent after its PUT and takes the ack back. The interleaving is gated: the ack's PUT waits
    until the committer has dropped the intent."""
    import trio

    from cachemgr.core.fs import CacheFs
    from cachemgr.core.sets import SetRegistry
    from cachemgr.store import LocalStore

    store = LocalStore(tmp_path / "store")
    core = CacheFs.load(tmp_path / "cache")
    iid = "a41be007-7-1"

    class Parts:
        def __init__(self):
            self.published: set[int] = set()

        async def sync(self, dirs):
            return None

    class Gated:
        """The store, with the PUT of this node's ack held until `dropped` is set."""

        def __init__(self):
            self.waiting = trio.Event()   # the ack's PUT is held
            self.dropped = trio.Event()   # the committer dropped the intent

        def __getattr__(self, name):
            return getattr(store, name)

        async def put(self, key, data, **kw):
            if key == members.ack_key(iid, "b0b0b0b0"):
                self.waiting.set()
                await self.dropped.wait()
            return await store.put(key, data, **kw)

    gated = Gated()
    lease = lease_record.Lease(store=gated, node="b0b0b0b0", index=core.index, lease=30,
                          register_timeout=5)
    m = members.Members(store=gated, node="b0b0b0b0", index=core.index,
                        sets=SetRegistry(core.index), parts=Parts(), lease=lease, poll=1)

    async def main():
        key = members.intent_key(iid)
        await store.put(key, lease_record.encode_doc("intent", node="a41be007", path="step_7",
                                          roots=["step_7"], nodes=["b0b0b0b0"],
                                          written_ns=1))
        etag = (await store.head(key)).etag
        async with trio.open_nursery() as n:
            n.start_soon(m._ack, key, etag)
            await gated.waiting.wait()               # the node read the intent; its ack is due
            await members.drop_intent(store, iid)   # the committer: intent, then the acks
            gated.dropped.set()
        assert [i.key for i in await store.list(members.acks_prefix(iid))] == []
        assert m.acks_sent == 0
        await store.aclose()

    try:
        trio.run(main)
    finally:
        core.close()


def test_a_renewal_answered_after_the_lease_ran_out_starts_a_new_generation(tmp_path):
    """cachemgr.tiering.lease.Lease: a renewal PUT the store answers after the lease ran out may
    have landed when other nodes already counted this node gone, so the node registers again under
    a new, larger generation (kept in the index, so a restart never reuses one); `ensure`,
    called before every write of the protocol, does the same once the lease ran out, and
    nothing at all while it holds. The renewal's lateness is gated, not slept through."""
    import trio

    from cachemgr.core.fs import CacheFs
    from cachemgr.store import LocalStore

    store = LocalStore(tmp_path / "store")
    core = CacheFs.load(tmp_path / "cache")

    class Gated:
        def __init__(self):
            self.held = None  # a trio.Event the next member PUT waits for, once
            self.puts = 0

        def __getattr__(self, name):
            return getattr(store, name)

        async def put(self, key, data, **kw):
            self.puts += 1
            if self.held is not None:
                ev, self.held = self.held, None
                await ev.wait()
            return await store.put(key, data, **kw)

    gated = Gated()
    lease = lease_record.Lease(store=gated, node="b0b0b0b0", index=core.index, lease=2,
                          register_timeout=5)

    async def stored() -> dict:
        return json.loads(await store.get(lease_record.member_key("b0b0b0b0")))

    async def main():
        assert not lease.holds()
        assert await lease.renew()  # the first registration is a new generation
        gen1 = lease.generation
        assert lease.holds() and (await stored())["generation"] == gen1 and lease.lapses == 0
        assert not await lease.renew()  # answered in time: same generation
        puts = gated.puts
        await lease.ensure()  # holds: no request
        assert gated.puts == puts
        # A renewal held until the lease ran out by the node's own clock.
        gate = trio.Event()
        gated.held = gate
        async with trio.open_nursery() as n:
            n.start_soon(lease.renew)
            while lease.holds():
                await trio.sleep(0.05)
            gate.set()
        assert lease.lapses == 1 and lease.generation > gen1 and lease.holds()
        assert (await stored())["generation"] == lease.generation
        assert int(core.index.meta("lease_generation")) == lease.generation
        # Out of time without any renewal: ensure registers again first.
        gen2 = lease.generation
        lease._sent -= 10
        assert not lease.holds()
        await lease.ensure()
        assert lease.lapses == 2 and lease.generation > gen2 and lease.holds()
        await store.aclose()

    try:
        trio.run(main)
    finally:
        core.close()
