"""Commit rules, in-process: the core with tiering hooks attached but the upload service not
running, so every set stays exactly where the hooks put it (deterministic, no FUSE, no store
traffic). What each rule means is in docs/SEMANTICS.md "When a set is committed". At the end,
the tiering services themselves in-process (cachemgr.tiering.uploadqueue, cachemgr.tiering.publish):
their workers driven against a file:// store, without FUSE."""

import os

import pytest

from cachemgr.core.cache import Cache
from cachemgr.core.fs import CacheFs
from cachemgr.core.hooks import NO_KERNEL
from cachemgr.core.sets import SetRegistry, is_temp_name
from cachemgr.engine import Engine, EngineConfig
from cachemgr.host.foreground import Foreground
from cachemgr.store import LocalStore

ROOT = 1
O_W = os.O_WRONLY | os.O_CREAT | os.O_TRUNC


def attach(cache: Cache, store: LocalStore,
           cfg: EngineConfig | None = None) -> tuple[CacheFs, Engine]:
    """An Engine over `cache`, and the core over both, built as ckptfs.daemon builds them."""
    t = Engine(cache, store, cfg or EngineConfig(), foreground=Foreground(), kernel=NO_KERNEL)
    core = CacheFs(cache, hooks=t.commits, reads=t.restorer, room=t.space)
    return core, t


@pytest.fixture
def built(tmp_path):
    core, t = attach(Cache.open(tmp_path / "cache"), LocalStore(tmp_path / "store"))
    yield core, t
    assert core.check_consistency() == []


@pytest.fixture
def tiering(built):
    return built[1]


@pytest.fixture
def fs(built):
    return built[0]


def sets(fs) -> dict[str, str]:
    """{path: state} of the newest set of each path."""
    out = {}
    for s in SetRegistry(fs.index).recent(1000):
        out[s.path] = s.state
    return out


def write_file(fs, parent: int, name: bytes, data: bytes = b"x", fsync: bool = False) -> int:
    """open(O_CREAT|O_TRUNC) + write + close, as the kernel would send it."""
    existing = fs.index.lookup(parent, name)
    if existing is None:
        res, node = fs.create(parent, name, 0o644, O_W, 0, 0)
    else:
        node = fs.cache.table.get(existing)
        res = fs.open(existing, O_W)
    fs.write(res.fh, 0, data)
    if fsync:
        fs.fsync(res.fh, False)
    fs.flush(res.fh)
    fs.release(res.fh)
    return node.ino


def mkdir(fs, parent: int, name: bytes) -> int:
    return fs.mkdir(parent, name, 0o755, 0, 0).ino


@pytest.mark.parametrize("name,temp", [
    ("model.pt.tmp", True), (".metadata.tmp", True), ("tmp-checkpoint-500", True),
    ("step_100.tmp", True), ("42.orbax-checkpoint-tmp-1700000000", True), ("x.partial", True),
    ("model.pt", False), ("step_100", False), ("latest", False), ("__0_0.distcp", False),
    ("checkpoint-500", False), ("template.json", False), ("attempt_3", False),
])
def test_temporary_names(name, temp):
    assert is_temp_name(name) == temp


def test_dcp_commits_at_metadata_rename_only(fs):
    d = mkdir(fs, ROOT, b"step_100")
    for r in range(2):
        write_file(fs, d, f"__{r}_0.distcp".encode(), os.urandom(1000), fsync=True)
    write_file(fs, d, b".metadata.tmp", b"meta", fsync=True)
    assert sets(fs) == {}  # shards and the tmp metadata: no set yet
    fs.rename(d, b".metadata.tmp", d, b".metadata")
    assert sets(fs) == {"step_100": "committed"}
    reg = SetRegistry(fs.index)
    (s,) = reg.recent(1)
    assert s.kind == "dir" and s.reason == "dcp"
    assert [f[0] for f in reg.files(s.seq)] == [".metadata", "__0_0.distcp", "__1_0.distcp"]


def test_dcp_resave_supersedes_the_unfinished_set(fs):
    d = mkdir(fs, ROOT, b"ck")
    write_file(fs, d, b"__0_0.distcp", b"v1")
    write_file(fs, d, b".metadata.tmp", b"m1")
    fs.rename(d, b".metadata.tmp", d, b".metadata")
    # The re-save overwrites the shard in place (O_TRUNC) while the old .metadata exists:
    write_file(fs, d, b"__0_0.distcp", b"v2")
    reg = SetRegistry(fs.index)
    assert reg.recent(1)[0].state == "superseded"
    fs.unlink(d, b".metadata")
    write_file(fs, d, b".metadata.tmp", b"m2")
    fs.rename(d, b".metadata.tmp", d, b".metadata")
    states = [s.state for s in reg.recent(10)]
    assert states == ["superseded", "committed"]


def test_torch_save_tmp_then_rename(fs):
    d = mkdir(fs, ROOT, b"ckpts")
    write_file(fs, d, b"model.pt.tmp", b"weights")
    assert sets(fs) == {}
    fs.rename(d, b"model.pt.tmp", d, b"model.pt")
    assert sets(fs) == {"ckpts/model.pt": "committed"}
    fs.symlink(d, b"latest.tmp", b"model.pt", 0, 0)
    assert "ckpts/latest.tmp" not in sets(fs)
    fs.rename(d, b"latest.tmp", d, b"latest")
    assert sets(fs)["ckpts/latest"] == "committed"


def test_file_closed_outside_open_sets_commits_itself(fs):
    write_file(fs, ROOT, b"epoch=3.ckpt")
    assert sets(fs) == {"epoch=3.ckpt": "committed"}
    # Overwriting it before it is durable supersedes the first commit; closing commits again.
    write_file(fs, ROOT, b"epoch=3.ckpt", b"again")
    reg = SetRegistry(fs.index)
    assert [s.state for s in reg.recent(10)] == ["superseded", "committed"]


def test_directory_rename_commits_and_temp_dir_contents_do_not(fs):
    tmp = mkdir(fs, ROOT, b"step_7.tmp")
    sub = mkdir(fs, tmp, b"shards")
    for r in range(3):
        write_file(fs, sub, f"rank{r}.pt".encode())
    assert sets(fs) == {}
    fs.rename(ROOT, b"step_7.tmp", ROOT, b"step_7")
    assert sets(fs) == {"step_7": "committed"}
    (s,) = SetRegistry(fs.index).recent(1)
    assert [f[0] for f in SetRegistry(fs.index).files(s.seq)] == [
        "shards/rank0.pt", "shards/rank1.pt", "shards/rank2.pt"]
    # Writing into a committed directory set makes no set of its own.
    write_file(fs, sub, b"rank3.pt")
    assert set(sets(fs)) == {"step_7"}


def test_deleting_a_file_before_its_upload_supersedes_the_set(fs):
    d = mkdir(fs, ROOT, b"step_1.tmp")
    write_file(fs, d, b"a.bin")
    write_file(fs, d, b"b.bin")
    fs.rename(ROOT, b"step_1.tmp", ROOT, b"step_1")
    b = fs.lookup(d, b"b.bin").ino
    fs.forget(b, 1)
    fs.unlink(d, b"b.bin")
    (s,) = SetRegistry(fs.index).recent(1)
    assert s.state == "superseded" and "deleted" in s.error
    # Removing the set's root deletes it.
    fs.unlink(d, b"a.bin")
    fs.rmdir(ROOT, b"step_1")
    assert sets(fs) == {"step_1": "superseded"}


def test_deleting_a_committed_set_root(fs):
    write_file(fs, ROOT, b"model.pt")
    fs.unlink(ROOT, b"model.pt")
    # 'deleting' until the (here not running) service has removed any manifest of the path.
    assert sets(fs) == {"model.pt": "deleting"}


def test_explicit_commit_absorbs_per_file_sets(fs, tiering):
    d = mkdir(fs, ROOT, b"plain")
    for r in range(2):
        write_file(fs, d, f"rank{r}.bin".encode())
    assert sets(fs) == {"plain/rank0.bin": "committed", "plain/rank1.bin": "committed"}
    tiering.commit_path("plain")
    assert sets(fs) == {"plain/rank0.bin": "superseded", "plain/rank1.bin": "superseded",
                        "plain": "committed"}


def test_crash_while_writing_supersedes_commits_of_old_content(tmp_path):
    core, _ = attach(Cache.open(tmp_path / "cache"), LocalStore(tmp_path / "store"))
    write_file(core, ROOT, b"model.pt", b"v1")
    ino = core.lookup(ROOT, b"model.pt").ino
    res = core.open(ino, os.O_WRONLY)  # a writer is active when the daemon dies
    core.write(res.fh, 0, b"v2-partial")
    version = core.cache.table.get(ino).version
    core.index.conn.close()  # kill -9: nothing is released or flushed
    again, t = attach(Cache.open(tmp_path / "cache"), LocalStore(tmp_path / "store"))
    t.commits.recover()
    row = again.index.conn.execute(
        "SELECT version, writing FROM inodes WHERE ino=?", (ino,)).fetchone()
    assert row == (version + 1, 0)
    # model.pt v1 was committed at its close and never uploaded: it is still publishable only
    # if its bytes were unchanged, which the crash cannot promise.
    reg = SetRegistry(again.index)
    assert [s.state for s in reg.recent(10)] == ["superseded"]
    assert again.check_consistency() == []


# -- the tiering services in-process (no FUSE): uploads and publication in commit order --------

def _drive(t: Engine, until, limit: float = 30.0) -> None:
    """Run the upload workers and the namespace worker until `until()` holds (checked each
    time every task is blocked: on the store, or idle), then stop them."""
    import trio
    import trio.testing

    async def main() -> None:
        with trio.fail_after(limit):
            async with trio.open_nursery() as n:
                n.start_soon(t.uploads.worker)
                n.start_soon(t.publisher.worker)
                while not until():
                    await trio.testing.wait_all_tasks_blocked(0.01)
                n.cancel_scope.cancel()

    trio.run(main)


def _has_manifest(store: LocalStore, path: str) -> bool:
    import trio

    from cachemgr.format.manifest import manifest_key
    from cachemgr.store import NotFound

    async def head() -> bool:
        try:
            await store.head(manifest_key(path))
        except NotFound:
            return False
        return True

    return trio.run(head)


def test_publication_waits_for_the_set_committed_before_it(tmp_path):
    store = LocalStore(tmp_path / "store")
    core, t = attach(Cache.open(tmp_path / "cache"), store, EngineConfig(file_concurrency=1))
    a = write_file(core, ROOT, b"a.pt", b"A" * 1000)
    write_file(core, ROOT, b"b.pt", b"B" * 1000)
    seq_a, seq_b = (s.seq for s in t.sets.recent(10))
    # a.pt's upload is held back: b.pt is uploaded first, and is not published before a.pt.
    t.uploads.drop(a, core.cache.table.get(a).version)
    # (b.pt's upload done and its publish event taken: both happen without an await between
    # them and the decision to hold it back.)
    _drive(t, lambda: t.uploads.statistics().done == 1 and
           t.publisher.statistics().events == 0)
    assert t.publisher.blocked_by(seq_b) == seq_a
    assert sets(core) == {"a.pt": "committed", "b.pt": "uploading"}
    assert not _has_manifest(store, "a.pt") and not _has_manifest(store, "b.pt")
    # a.pt uploads and publishes; its state change releases b.pt, published after it.
    t.uploads.enqueue(a, core.cache.table.get(a).version)
    _drive(t, lambda: sets(core) == {"a.pt": "durable", "b.pt": "durable"})
    assert t.publisher.blocked_by(seq_b) is None
    assert _has_manifest(store, "a.pt") and _has_manifest(store, "b.pt")
    assert t.publisher.statistics().published == 2
    durable = {s.seq: s.durable_ns for s in t.sets.recent(10)}
    assert durable[seq_a] <= durable[seq_b]
    st = t.status()
    assert st["uploads"]["done"] == 2 and st["pending_sets"] == 0
    assert st["services"]["commit"]["commits"] == 2
    assert core.check_consistency() == []


def _queues(t: Engine) -> tuple:
    p, u = t.publisher, t.uploads
    return (list(p._events), {k: set(v) for k, v in p._absorb.items()},
            {k: j.prio for k, j in u._jobs.items()})


def _failing_after(monkeypatch, obj, name: str) -> None:
    """Make hook `name` of `obj` do all its work, then fail: the operation's transaction rolls
    back after the hook queued whatever it queues (as a full cache disk at COMMIT would)."""
    real = getattr(obj, name)

    def hook(*a, **kw):
        real(*a, **kw)
        raise RuntimeError("injected: the operation fails after its hook")
    monkeypatch.setattr(obj, name, hook)


def test_an_operation_that_rolls_back_queues_nothing(fs, tiering, monkeypatch):
    """Work queued by a commit hook takes effect only if the operation's transaction
    commits: a rename that fails after its hook ran leaves no unpublish of the set it would have
    moved, no absorbed set under a seq that never was, and the upload queue as it was."""
    d = mkdir(fs, ROOT, b"step_1.tmp")
    write_file(fs, d, b"a.bin", b"a" * 100)
    fs.rename(ROOT, b"step_1.tmp", ROOT, b"step_1")
    f = write_file(fs, ROOT, b"model.pt", b"m" * 100)
    before = _queues(tiering)
    assert before[2], "the committed files' uploads are queued (the service is not running)"
    assert sets(fs) == {"step_1": "committed", "model.pt": "committed"}

    _failing_after(monkeypatch, tiering.commits, "on_rename")
    with pytest.raises(RuntimeError, match="injected"):
        fs.rename(ROOT, b"step_1", ROOT, b"step_2")
    assert sets(fs) == {"step_1": "committed", "model.pt": "committed"}
    assert _queues(tiering) == before

    # a rewrite that fails after its content-change hook: the old content's upload stays queued
    # (the set that needs it is still committed)
    _failing_after(monkeypatch, tiering.commits, "on_content_change")
    with pytest.raises(RuntimeError, match="injected"):
        fs.open(f, os.O_WRONLY | os.O_TRUNC)
    assert sets(fs) == {"step_1": "committed", "model.pt": "committed"}
    assert _queues(tiering) == before

    # and once the operations succeed, they queue as before
    monkeypatch.undo()
    fs.rename(ROOT, b"step_1", ROOT, b"step_2")
    assert sets(fs)["step_2"] == "committed"
    assert _queues(tiering) != before


def test_a_close_the_full_disk_kept_from_being_recorded_is_recorded_at_the_next(fs, monkeypatch):
    """The last close of a file whose release transaction fails (the cache disk full even after
    the index reserve) is not lost: the kernel does not retry a release, so the core closes the
    content again at the next release, and its set is committed then."""
    from cachemgr.core.errors import IndexFull

    res, node = fs.create(ROOT, b"model.pt", 0o644, O_W, 0, 0)
    fs.write(res.fh, 0, b"w" * 1000)
    fs.flush(res.fh)
    real = fs.fileops._released
    fail = [True]

    def released(*a, **kw):
        if fail[0]:
            raise IndexFull("injected: cache disk full", released=False)
        return real(*a, **kw)
    monkeypatch.setattr(fs.fileops, "_released", released)
    with pytest.raises(IndexFull):
        fs.release(res.fh)
    assert sets(fs) == {}                     # not committed: the close is not recorded
    fail[0] = False                           # the user deleted something: room again
    write_file(fs, ROOT, b"other.pt")         # any later close retries it
    assert sets(fs) == {"model.pt": "committed", "other.pt": "committed"}
    assert fs.cache.table.get(node.ino).writing == 0
    assert fs.fileops._unclosed == {}
