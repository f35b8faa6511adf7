"""Crash behaviour: `kill -9` of the daemon, then a remount of the same cache dir.

What is asserted is the crash contract of `cachemgr/core/fs.py` (and docs/SEMANTICS.md): after a
kill -9 (the OS page cache survives) the remount shows the tree as of the last completed
operation; every byte whose write() returned is in its file, fsync'd or not (sizes are recovered
from the cache files); files unlinked while open are gone with their cache files. Afterwards the
cache index passes `check_consistency()`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import random
import stat
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cachemgr.core.cache import Cache
from cachemgr.core.fs import CacheFs
from cachemgr.core.hooks import NO_HOOKS, NO_LIMIT, NO_STORE
from cachemgr.core.index import Index
from tests.conftest import REPO, _alive, ckptfs_cmd, is_mounted, run_cli, wait_for

MiB = 1 << 20


def payload(seed: int, n: int) -> bytes:
    return random.Random(seed).randbytes(n)


def write_file(path: Path, data: bytes, *, fsync: bool = True, chunk: int = MiB) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for off in range(0, len(data), chunk):
            assert os.write(fd, data[off:off + chunk]) == len(data[off:off + chunk])
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def snapshot(root: Path) -> dict[str, object]:
    """The tree under `root`: relpath -> bytes (file) | "dir" | ("link", target)."""
    out: dict[str, object] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p))
                if name in dirnames:
                    dirnames.remove(name)
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = "dir"
            else:
                assert stat.S_ISREG(st.st_mode), (rel, oct(st.st_mode))
                data = p.read_bytes()
                assert st.st_size == len(data), rel
                out[rel] = data
    return out


def assert_tree(root: Path, expected: dict[str, object]) -> None:
    got = snapshot(root)
    assert sorted(got) == sorted(expected), (
        f"missing {sorted(set(expected) - set(got))}, extra {sorted(set(got) - set(expected))}")
    for rel, want in expected.items():
        have = got[rel]
        if isinstance(want, bytes):
            assert isinstance(have, bytes), rel
            assert len(have) == len(want), f"{rel}: size {len(have)} != {len(want)}"
            assert have == want, f"{rel}: content differs"
        else:
            assert have == want, rel


def open_cache_unrecovered(cache_dir: Path) -> CacheFs:
    """A CacheFs on the cache dir *without* the recovery `CacheFs.load` runs, to see what
    recovery finds (no daemon may hold the cache)."""
    index = Index.open(cache_dir / "index.sqlite", uid=os.getuid(), gid=os.getgid())
    return CacheFs(Cache(cache_dir, index), hooks=NO_HOOKS, reads=NO_STORE, room=NO_LIMIT)


def check_cache_offline(cache_dir: Path, *, expect_clean: bool) -> None:
    """Open the cache offline and check its invariants. `expect_clean` (after a clean unmount):
    recovery must find nothing to do. Either way, after recovery the index and the cache files
    agree, and a second recovery changes nothing."""
    fs = open_cache_unrecovered(cache_dir) if expect_clean else CacheFs.load(cache_dir)
    try:
        if expect_clean:
            report = fs.cache.recover()
            assert not any(report.values()), f"a clean unmount left work for recovery: {report}"
        assert fs.check_consistency() == []
        again = fs.cache.recover()
        assert not any(again.values()), f"recovery is not idempotent: {again}"
        n_reg = len(fs.index.regular_files())
        data_files = os.listdir(cache_dir / "data")
        assert len(data_files) == n_reg, (sorted(data_files), n_reg)
    finally:
        fs.close()


def data_file_count(cache_dir: Path) -> int:
    return len(os.listdir(cache_dir / "data"))


# ----------------------------------------------------------------------------------------------


def test_kill9_then_remount_keeps_everything(mnt) -> None:
    root = mnt.path
    exp: dict[str, object] = {}

    # A checkpoint directory written the trainer way: tmp file, fsync, rename.
    (root / "ckpt").mkdir()
    exp["ckpt"] = "dir"
    for step in (1, 2):
        d = root / "ckpt" / f"step_{step}"
        d.mkdir()
        exp[f"ckpt/step_{step}"] = "dir"
        for shard in range(3):
            data = payload(step * 100 + shard, 2 * MiB + 4099 * shard + step)
            tmp = d / f".shard{shard}.tmp"
            write_file(tmp, data)
            os.rename(tmp, d / f"shard{shard}.bin")
            exp[f"ckpt/step_{step}/shard{shard}.bin"] = data
    # `latest` replaced atomically: symlink tmp + rename over the old link.
    os.symlink("step_1", root / "ckpt" / "latest")
    os.symlink("step_2", root / "ckpt" / ".latest.tmp")
    os.rename(root / "ckpt" / ".latest.tmp", root / "ckpt" / "latest")
    exp["ckpt/latest"] = ("link", "step_2")
    # A file fsync'd, then overwritten by rename of another fsync'd file.
    write_file(root / "ckpt" / "meta.json", b'{"step": 1}')
    write_file(root / "ckpt" / "meta.json.tmp", b'{"step": 2, "loss": 0.5}')
    os.rename(root / "ckpt" / "meta.json.tmp", root / "ckpt" / "meta.json")
    exp["ckpt/meta.json"] = b'{"step": 2, "loss": 0.5}'
    # A whole directory written under a tmp name and renamed into place.
    tmpdir = root / "ckpt" / "step_3.tmp"
    (tmpdir / "nested" / "deeper").mkdir(parents=True)
    big = payload(3, 5 * MiB + 7)
    write_file(tmpdir / "nested" / "deeper" / "big.bin", big)
    write_file(tmpdir / "small.bin", b"s" * 10)
    os.rename(tmpdir, root / "ckpt" / "step_3")
    exp.update({"ckpt/step_3": "dir", "ckpt/step_3/nested": "dir",
                "ckpt/step_3/nested/deeper": "dir",
                "ckpt/step_3/nested/deeper/big.bin": big, "ckpt/step_3/small.bin": b"s" * 10})
    # A deep tree of empty directories and a dangling symlink.
    (root / "a" / "b" / "c" / "d").mkdir(parents=True)
    exp.update({"a": "dir", "a/b": "dir", "a/b/c": "dir", "a/b/c/d": "dir"})
    os.symlink("../nowhere/at/all", root / "a" / "b" / "dangling")
    exp["a/b/dangling"] = ("link", "../nowhere/at/all")
    # Written and closed, never fsync'd.
    unsynced = payload(7, 3 * MiB + 1)
    write_file(root / "unsynced.bin", unsynced, fsync=False)
    exp["unsynced.bin"] = unsynced
    # fsync'd, then truncated shorter (setattr: one committed operation).
    trunc = payload(8, 3 * MiB)
    write_file(root / "truncated.bin", trunc)
    os.truncate(root / "truncated.bin", MiB + 5)
    exp["truncated.bin"] = trunc[:MiB + 5]
    # Removed names stay removed.
    write_file(root / "gone.bin", b"x" * 1000)
    os.unlink(root / "gone.bin")
    (root / "gone-dir").mkdir()
    os.rmdir(root / "gone-dir")
    # An xattr (metadata operation).
    os.setxattr(root / "ckpt" / "meta.json", "user.step", b"2")

    held: list[int] = []
    # Still open at the kill, written after its last fsync, never flushed or closed: the index
    # holds a stale size; every byte written must come back.
    pending_head = payload(9, 2 * MiB)
    pending_tail = payload(10, 3 * MiB + 333)
    fd = os.open(root / "pending.bin", os.O_WRONLY | os.O_CREAT, 0o644)
    held.append(fd)
    assert os.write(fd, pending_head) == len(pending_head)
    os.fsync(fd)
    assert os.write(fd, pending_tail) == len(pending_tail)
    exp["pending.bin"] = pending_head + pending_tail
    # An fsync'd file overwritten in the middle through a descriptor that stays open.
    mid = bytearray(payload(11, 4 * MiB))
    write_file(root / "overwritten.bin", bytes(mid))
    fd = os.open(root / "overwritten.bin", os.O_WRONLY)
    held.append(fd)
    patch = payload(12, MiB)
    assert os.pwrite(fd, patch, MiB + 17) == len(patch)
    mid[MiB + 17:2 * MiB + 17] = patch
    exp["overwritten.bin"] = bytes(mid)
    # Unlinked while open (nlink 0, kept for its descriptor): gone after the crash.
    fd = os.open(root / "unlinked-open.bin", os.O_RDWR | os.O_CREAT, 0o644)
    held.append(fd)
    assert os.write(fd, payload(13, 2 * MiB)) == 2 * MiB
    os.fsync(fd)
    os.unlink(root / "unlinked-open.bin")
    assert os.pread(fd, 4, 0) == payload(13, 4)

    assert_tree(root, exp)
    n_files = sum(isinstance(v, bytes) for v in exp.values())
    assert data_file_count(mnt.cache_dir) == n_files + 1  # + the unlinked, still open one

    mnt.kill9()
    for fd in held:
        with contextlib.suppress(OSError):
            os.close(fd)
    with pytest.raises(OSError) as ei:
        os.listdir(root)
    assert ei.value.errno in (errno.ENOTCONN, errno.ECONNABORTED)

    mnt.start()  # cleans up the dead mount point, recovers the cache
    assert_tree(root, exp)
    assert os.getxattr(root / "ckpt" / "meta.json", "user.step") == b"2"
    assert os.readlink(root / "ckpt" / "latest") == "step_2"
    assert data_file_count(mnt.cache_dir) == n_files  # the orphan's cache file is gone
    # The recovered mount is fully usable.
    with open(root / "pending.bin", "ab") as f:
        f.write(b"more")
    exp["pending.bin"] = pending_head + pending_tail + b"more"
    assert "recovery:" in mnt.log_text()

    # A file open for writing at the kill is in no set (they commit at their next close:
    # docs/SEMANTICS.md "Crash of the daemon"); umount says so (exit 12 without the option)
    assert mnt.status()["tiering"]["unsaved"] == ["overwritten.bin"]  # pending.bin: closed above
    mnt.stop("--allow-unsaved")
    check_cache_offline(mnt.cache_dir, expect_clean=True)
    mnt.start()
    assert_tree(root, exp)


def test_recovery_report_after_kill9(mnt) -> None:
    """The cache a kill -9 leaves behind, opened offline: recovery fixes exactly the stale size
    and the orphan, the result is consistent, and a daemon then serves the recovered tree."""
    root = mnt.path
    write_file(root / "synced.bin", payload(1, MiB))
    fd_stale = os.open(root / "stale.bin", os.O_WRONLY | os.O_CREAT, 0o644)
    data = payload(2, 2 * MiB + 1)
    assert os.write(fd_stale, data) == len(data)  # never flushed: the index says size 0
    fd_orphan = os.open(root / "orphan.bin", os.O_RDWR | os.O_CREAT, 0o644)
    os.write(fd_orphan, b"o" * 100)
    os.unlink(root / "orphan.bin")
    mnt.kill9()
    for fd in (fd_stale, fd_orphan):
        with contextlib.suppress(OSError):
            os.close(fd)
    subprocess.run(["fusermount3", "-u", "-z", str(root)], check=True, capture_output=True)

    fs = open_cache_unrecovered(mnt.cache_dir)
    try:
        assert fs.cache.recover() == {"orphans": 1, "resized": 1, "stray_files": 0,
                                "missing_files": 0}
        assert fs.check_consistency() == []
        assert not any(fs.cache.recover().values())
    finally:
        fs.close()
    check_cache_offline(mnt.cache_dir, expect_clean=True)
    mnt.start()
    assert sorted(os.listdir(root)) == ["stale.bin", "synced.bin"]
    assert (root / "stale.bin").read_bytes() == data
    assert (root / "synced.bin").read_bytes() == payload(1, MiB)


# ----------------------------------------------------------------------------------------------
# kill -9 while another process is writing

WRITER = r"""
import os, random, sys
path, progress, seed, chunk, sync_every, cap = sys.argv[1:7]
seed, chunk, sync_every, cap = int(seed), int(chunk), int(sync_every), int(cap)
prog = os.open(progress, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
off = 0
try:
    while off < cap:
        buf = random.Random(seed * 1000003 + off // chunk).randbytes(chunk)
        n = os.write(fd, buf)
        assert n == chunk, n
        off += n
        os.write(prog, b"W %d\n" % off)
        if off % sync_every == 0:
            os.fsync(fd)
            os.write(prog, b"S %d\n" % off)
except OSError as e:
    os.write(prog, b"E %d\n" % e.errno)
    sys.exit(3)
sys.exit(0)
"""


def writer_stream(seed: int, n: int, chunk: int) -> bytes:
    out = bytearray()
    k = 0
    while len(out) < n:
        out += random.Random(seed * 1000003 + k).randbytes(chunk)
        k += 1
    return bytes(out[:n])


def read_progress(progress: Path) -> dict[str, int]:
    last = {"W": 0, "S": 0}
    for line in progress.read_text().split("\n")[:-1]:  # complete lines only
        kind, _, val = line.partition(" ")
        last[kind] = int(val)
    return last


def test_kill9_during_writer_loop(mnt) -> None:
    """Four times in a row: another process writes a large file (fsync every 2 MiB, logging its
    progress outside the mount), the daemon is kill -9'd mid-loop, the mount comes back on the
    same cache dir. Every fsync'd byte, indeed every acknowledged byte, of every round is there,
    and the file is a prefix of what the writer meant to write."""
    chunk, sync_every, cap = 256 * 1024, 2 * MiB, 2048 * MiB
    rounds = 4
    done: list[tuple[Path, int, int, int]] = []  # (file, seed, fsync'd bytes, acked bytes)

    def verify_all() -> None:
        for path, seed, synced, acked in done:
            size = path.stat().st_size
            assert size >= synced, f"{path.name}: {size} < fsync'd {synced}"
            # Every acknowledged write is in the file (page cache survives a process crash);
            # at most the one write in flight at the kill may have landed beyond it.
            assert acked <= size <= acked + chunk, (path.name, size, acked)
            with open(path, "rb") as f:
                data = f.read()
            assert len(data) == size
            assert data == writer_stream(seed, size, chunk), f"{path.name}: content differs"

    for r in range(rounds):
        path = mnt.path / f"round{r}.bin"
        progress = mnt.path.parent / f"progress{r}.txt"
        seed = 17 + r
        child = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(path), str(progress), str(seed), str(chunk),
             str(sync_every), str(cap)], cwd="/")
        try:
            threshold = (4 + 3 * r) * MiB
            wait_for(lambda progress=progress, threshold=threshold: progress.exists()
                     and read_progress(progress)["S"] >= threshold,
                     timeout=120, what=f"round {r} writer to fsync {threshold} bytes")
            mnt.kill9()
            rc = child.wait(timeout=60)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(timeout=30)
        prog = read_progress(progress)
        # The writer was cut off mid-loop by the dead mount (ENOTCONN or a failed write).
        assert rc == 3, (rc, prog)
        assert prog["S"] >= threshold and prog["W"] < cap
        assert prog.get("E") in (errno.ENOTCONN, errno.ECONNABORTED), prog
        done.append((path, seed, prog["S"], prog["W"]))
        mnt.start()  # next round on the same cache dir and mount point
        verify_all()

    mnt.stop("--allow-unsaved")  # the rounds' files are in no set: below
    mnt.start()
    verify_all()
    assert sorted(os.listdir(mnt.path)) == [f"round{r}.bin" for r in range(rounds)]
    # each round's file was open for writing at its kill: in no set (umount says so)
    assert sorted(mnt.status()["tiering"]["unsaved"]) == [f"round{r}.bin"
                                                          for r in range(rounds)]
    mnt.stop("--allow-unsaved")
    check_cache_offline(mnt.cache_dir, expect_clean=True)
    mnt.start()


# ----------------------------------------------------------------------------------------------
# concurrent writers


def test_concurrent_writer_threads(mnt) -> None:
    n, size, chunk = 4, 16 * MiB, MiB
    datas = [payload(1000 + i, size + i * 4097) for i in range(n)]
    barrier = threading.Barrier(n)

    def work(i: int) -> None:
        fd = os.open(mnt.path / f"w{i}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            barrier.wait(timeout=60)  # all four write at the same time
            d = datas[i]
            for off in range(0, len(d), chunk):
                assert os.write(fd, d[off:off + chunk]) == len(d[off:off + chunk])
                if off % (4 * chunk) == 0:
                    os.fsync(fd)
            os.fsync(fd)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(work, i) for i in range(n)]
        for f in futures:
            f.result(timeout=300)  # re-raises a writer's failure
    for i in range(n):
        assert (mnt.path / f"w{i}.bin").read_bytes() == datas[i], f"w{i}.bin differs"
    mnt.kill9()
    mnt.start()
    for i in range(n):
        assert (mnt.path / f"w{i}.bin").read_bytes() == datas[i], f"w{i}.bin differs"


PROC_WRITER = r"""
import hashlib, os, random, sys
path, seed, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
data = random.Random(seed).randbytes(size)
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
sys.stdin.read(1)  # start together
for off in range(0, size, 1 << 20):
    os.pwrite(fd, data[off:off + (1 << 20)], off)
os.fsync(fd)
os.close(fd)
print(hashlib.sha256(data).hexdigest())
"""


def test_concurrent_writer_processes(mnt) -> None:
    n, size = 4, 16 * MiB
    procs = [subprocess.Popen([sys.executable, "-c", PROC_WRITER, str(mnt.path / f"p{i}.bin"),
                               str(2000 + i), str(size + i)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")
             for i in range(n)]
    # Every writer has created its file (it is then blocked on stdin): release them together.
    wait_for(lambda: all((mnt.path / f"p{i}.bin").exists() for i in range(n)),
             what="writers to open their files")
    for p in procs:
        p.stdin.write("g")
        p.stdin.close()
    digests = []
    for p in procs:
        out = p.stdout.read()
        assert p.wait(timeout=300) == 0
        digests.append(out.strip())
    for i in range(n):
        data = (mnt.path / f"p{i}.bin").read_bytes()
        assert len(data) == size + i
        assert hashlib.sha256(data).hexdigest() == digests[i]
        assert data == payload(2000 + i, size + i)
    mnt.remount()
    for i in range(n):
        assert hashlib.sha256((mnt.path / f"p{i}.bin").read_bytes()).hexdigest() == digests[i]


# ----------------------------------------------------------------------------------------------
# one cache dir, one daemon


def test_two_daemons_cannot_share_a_cache_dir(mnt, mount_factory) -> None:
    (mnt.path / "f").write_bytes(b"first")
    second = mount_factory("second", cache_dir=mnt.cache_dir)
    res = second.start("--store", f"file://{mnt.store_dir}", check=False)
    assert res.returncode == 4, res.stderr
    assert f"pid {mnt.pid}" in res.stderr
    assert not is_mounted(second.path)
    assert (mnt.path / "f").read_bytes() == b"first"
    # The lock dies with the daemon: after kill -9 the cache dir can be mounted elsewhere.
    mnt.kill9()
    second.start()
    assert (second.path / "f").read_bytes() == b"first"
    # ... and the first mount point, dead, cannot come back on the same cache dir.
    res = mnt.start(check=False)
    assert res.returncode == 4, res.stderr
    assert f"pid {second.pid}" in res.stderr
    assert not is_mounted(mnt.path)  # the failed attempt still cleaned up its dead mount
    second.stop()


def test_two_daemons_racing_for_one_cache_dir(tmp_path: Path) -> None:
    """Two `ckptfs mount` started at the same instant on one cache dir: exactly one wins, at
    every try; the lock, not the preflight check, decides."""
    from tests.conftest import require_fuse

    require_fuse()
    cache = tmp_path / "cache"
    for attempt in range(3):
        mps = [tmp_path / f"mp{attempt}-{i}" for i in range(2)]
        for mp in mps:
            mp.mkdir()
        procs = [subprocess.Popen(ckptfs_cmd("mount", str(mp), "--cache-dir", str(cache),
                                             "--store", f"file://{tmp_path / 'store'}"),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  cwd=REPO) for mp in mps]
        results = []
        for p in procs:
            out, err = p.communicate(timeout=120)
            results.append((p.returncode, out, err))
        try:
            codes = sorted(r[0] for r in results)
            assert codes == [0, 4], results
            winner = next(i for i in range(2) if results[i][0] == 0)
            loser = 1 - winner
            assert is_mounted(mps[winner]) and not is_mounted(mps[loser])
            err = results[loser][2].splitlines()
            assert len(err) == 1 and err[0].startswith("ckptfs: ") and "in use" in err[0]
            (mps[winner] / f"attempt{attempt}").write_bytes(b"x")
            res = run_cli("umount", str(mps[winner]))
            assert res.returncode == 0, res.stderr
        finally:
            for mp in mps:
                if is_mounted(mp):
                    run_cli("umount", str(mp))
                if is_mounted(mp):
                    subprocess.run(["fusermount3", "-u", "-z", str(mp)], capture_output=True,
                                   check=False)
    check_cache_offline(cache, expect_clean=True)
    fs = CacheFs.load(cache)
    try:
        assert len(os.listdir(cache / "data")) == 3
        assert fs.index.count_dentries() == 3  # attempt0..2, one written per winning mount
    finally:
        fs.close()


def test_kill9_daemon_releases_lock_promptly(mnt) -> None:
    pid = mnt.pid
    mnt.kill9()
    assert not _alive(pid)
    mnt.start()
    assert mnt.pid != pid
    assert (mnt.cache_dir / "lock").read_text().strip() == str(mnt.pid)
