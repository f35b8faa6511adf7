"""Real fio through a real mount, every job with `--verify=crc32c`: fio writes each block with a
checksummed header, then reads everything back and checks it.

Jobs: a sequential 1 MiB-block write (verified inline, and again by a separate `verify_only`
pass after a remount), random-offset 4 KiB writes, and 4 parallel writers (4 files, and 4 disjoint
regions of one shared file). A control test corrupts one block through the mount and requires
fio's verify to catch it, so a passing verify is known to have read the data.

fio missing: skipped locally, a failure in CI (scripts/setup.sh installs it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import IN_CI

MiB = 1 << 20


@pytest.fixture(scope="module")
def fio() -> str:
    exe = shutil.which("fio")
    if exe is None:
        if IN_CI:
            pytest.fail("fio is not installed (scripts/setup.sh installs it)")
        pytest.skip("fio is not installed (apt install fio)")
    return exe


def run_fio(fio: str, directory: Path, out_dir: Path, *args: str, check: bool = True,
            timeout: float = 240) -> tuple[subprocess.CompletedProcess, dict | None]:
    """Run one fio invocation with JSON output written to a file (fio prints warnings to stdout,
    which would corrupt `--output-format=json` on stdout). Returns the process and the JSON."""
    out = out_dir / f"fio-{len(list(out_dir.glob('fio-*.json')))}.json"
    cmd = [fio, "--output-format=json", f"--output={out}", f"--directory={directory}",
           "--ioengine=psync", "--verify_state_save=0", "--verify_fatal=1", *args]
    res = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout,
                         cwd=out_dir)
    data = None
    if out.exists() and out.stat().st_size:
        text = out.read_text()
        data = json.loads(text[text.index("{"):])
    if check:
        assert res.returncode == 0, (
            f"fio failed ({res.returncode}): {' '.join(cmd)}\n{res.stdout}\n{res.stderr}")
        assert data is not None, "fio wrote no JSON output"
        for job in data["jobs"]:
            assert job["error"] == 0, f"job {job['jobname']}: error {job['error']}"
    return res, data


def job_bytes(job: dict) -> tuple[int, int]:
    """(bytes written, bytes read): with verify, the read side is the verify pass."""
    return job["write"]["io_bytes"], job["read"]["io_bytes"]


def test_sequential_1m_write_verify(fio, mnt, tmp_path):
    size = 96 * MiB
    job = ["--name=seq", "--filename=seq.dat", "--rw=write", "--bs=1M", f"--size={size}",
           "--verify=crc32c", "--end_fsync=1"]
    _, out = run_fio(fio, mnt.path, tmp_path, *job)
    (j,) = out["jobs"]
    assert job_bytes(j) == (size, size)
    assert (mnt.path / "seq.dat").stat().st_size == size

    # A second, read-only verify pass from the cache after a remount.
    mnt.remount()
    before = (mnt.path / "seq.dat").stat()
    _, out = run_fio(fio, mnt.path, tmp_path, *job, "--verify_only")
    (j,) = out["jobs"]
    # verify_only accounts the skipped writes as written; the file must not have been touched.
    assert j["read"]["io_bytes"] == size
    after = (mnt.path / "seq.dat").stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


def test_random_4k_write_verify(fio, mnt, tmp_path):
    size = 24 * MiB
    _, out = run_fio(fio, mnt.path, tmp_path, "--name=rand", "--filename=rand.dat",
                     "--rw=randwrite", "--bs=4k", f"--size={size}", "--randseed=4242",
                     "--verify=crc32c", "--end_fsync=1")
    (j,) = out["jobs"]
    # With verify, fio keeps a random map: every 4k block written exactly once, then checked.
    assert job_bytes(j) == (size, size)
    assert j["write"]["total_ios"] == size // 4096
    assert (mnt.path / "rand.dat").stat().st_size == size


def test_parallel_4_jobs_write_verify(fio, mnt, tmp_path):
    per_job = 32 * MiB
    _, out = run_fio(fio, mnt.path, tmp_path, "--name=par", "--rw=write", "--bs=1M",
                     f"--size={per_job}", "--numjobs=4", "--verify=crc32c", "--end_fsync=1")
    jobs = out["jobs"]
    assert len(jobs) == 4
    for j in jobs:
        assert job_bytes(j) == (per_job, per_job), j["jobname"]
    files = sorted(p for p in mnt.path.iterdir() if p.name.startswith("par."))
    assert len(files) == 4, files
    assert all(p.stat().st_size == per_job for p in files)


def test_parallel_4_jobs_one_shared_file(fio, mnt, tmp_path):
    """4 writers into disjoint 16 MiB regions of one file: concurrent writes to one inode."""
    region = 16 * MiB
    _, out = run_fio(fio, mnt.path, tmp_path, "--name=shared", "--filename=shared.dat",
                     "--rw=write", "--bs=1M", f"--size={region}", f"--offset_increment={region}",
                     "--numjobs=4", "--verify=crc32c", "--end_fsync=1")
    jobs = out["jobs"]
    assert len(jobs) == 4
    for j in jobs:
        assert job_bytes(j) == (region, region), j["jobname"]
    assert (mnt.path / "shared.dat").stat().st_size == 4 * region


def test_verify_catches_corruption(fio, mnt, tmp_path):
    """Control: the verify pass really reads through the mount and fails on a bad block."""
    size = 8 * MiB
    job = ["--name=ctl", "--filename=ctl.dat", "--rw=write", "--bs=1M", f"--size={size}",
           "--verify=crc32c"]
    run_fio(fio, mnt.path, tmp_path, *job)
    fd = os.open(mnt.path / "ctl.dat", os.O_WRONLY)
    try:
        os.pwrite(fd, os.urandom(4096), 3 * MiB + 8192)
    finally:
        os.close(fd)
    res, out = run_fio(fio, mnt.path, tmp_path, *job, "--verify_only", check=False)
    assert res.returncode != 0, "fio verify did not notice a corrupted block"
    assert "crc32c" in res.stderr + res.stdout or (out and out["jobs"][0]["error"] != 0)
