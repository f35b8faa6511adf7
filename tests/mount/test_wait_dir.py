"""`ckptfs wait DIR` / `ckptfs.wait_durable(DIR)` on a directory that is not one set.

DeepSpeed (and MLPerf-Storage style jobs) write `global_stepN/*.pt` in place with torch.save and
then a `latest` file: every file is its own set. A wait on the directory waits for every set
committed under it at the call, and for every file under it still open for writing; it never
answers 0 while a file under it is in no set, and says how many sets it waited for
(docs/SEMANTICS.md "Waiting for a directory").

Gates, never sleeps: CKPTFS_FAULTS `put@<prefix>=hold:<gate>` holds the daemon's PUTs of keys
under <prefix> while the gate file exists (data uploads, or one set's manifest); the daemon logs
"wait DIR: N set(s) committed under it" once a directory wait has taken stock, which tells a
test that the wait is in progress before it changes what the wait looks at.
"""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

import pytest
import torch

import ckptfs
from ckptfs.mount import EXIT_ERROR, EXIT_NO_SET, EXIT_OK, EXIT_STORE
from tests.conftest import REPO, ckptfs_cmd, hold_uploads, run_cli, start_with_env, wait_for


def sets_under(m, rel: str) -> dict[str, str]:
    """path -> state of the newest set of each path at or under `rel`, as `status` shows it."""
    out: dict[str, str] = {}
    for s in m.status()["tiering"]["sets"]:
        if s["path"] == rel or s["path"].startswith(rel + "/"):
            out[s["path"]] = s["state"]
    return out


def waiting(m, rel: str, n: int = 1) -> bool:
    """The daemon has taken stock for the `n`-th directory wait on `rel`."""
    return m.log_text().count(f"wait {rel}: ") >= n


def start_wait(m, path: Path, rel: str, timeout: str = "120") -> subprocess.Popen:
    """`ckptfs wait PATH --timeout TIMEOUT` in a process of its own (stdout and stderr piped),
    returned once the daemon has taken stock for it (`rel`: PATH in the mount): what the test
    changes from then on, the wait sees."""
    n = m.log_text().count(f"wait {rel}: ")
    waiter = subprocess.Popen(ckptfs_cmd("wait", str(path), "--timeout", timeout),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=REPO)
    wait_for(lambda: waiting(m, rel, n + 1), timeout=60, what="the wait to take stock")
    return waiter


@pytest.fixture
def held(mount_factory, tmp_path):
    """(a started mount whose data uploads are held while the gate file exists, the gate):
    the test removes the gate to let them go."""
    gate = tmp_path / "data-held"
    m = mount_factory()
    start_with_env(m, hold_uploads(gate))
    return m, gate


def deepspeed_step(step: Path, ranks: int) -> list[str]:
    """A DeepSpeed-style checkpoint: per-rank files written in place by torch.save (no
    temporary name, no directory rename). Returns the file names in the order written."""
    step.mkdir()
    names = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(ranks)]
    names.append("mp_rank_00_model_states.pt")  # last: DeepSpeed saves the module after
    for i, name in enumerate(names):
        torch.save({"w": torch.full((64, 64), float(i)), "rank": i}, step / name)
    return names


def cli_wait(path: Path, *args: str) -> subprocess.CompletedProcess:
    return run_cli("wait", str(path), *args)


def one_line(res: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    assert res.returncode == code, (res.returncode, res.stdout, res.stderr)
    line = res.stderr.strip()
    assert line.startswith("ckptfs: ") and "\n" not in line and "Traceback" not in line, line
    for n in needles:
        assert n in line, line
    return line


def test_wait_dir_waits_for_every_file_set_of_a_deepspeed_step(mount_factory, s3_bucket,
                                                                tmp_path):
    """The whole flow on a real S3 endpoint: a wait started while every upload is held
    returns 0 only once the last file's set is published, counting the nested DCP directory
    as one set; `--timeout` exits 7 naming what is still pending; the API agrees."""
    import boto3
    import torch.distributed.checkpoint as dcp

    endpoint, bucket = s3_bucket
    data_gate, last_gate = tmp_path / "data-held", tmp_path / "last-manifest-held"
    last_gate.touch()
    m = mount_factory()
    # Data uploads held; and the manifest of the file written last (published last, in commit
    # order), so a release of the first gate makes every set but that one durable.
    last = "run/global_step100/mp_rank_00_model_states.pt"
    env = hold_uploads(data_gate)
    env["CKPTFS_FAULTS"] += f",put@manifests/{last}=hold:{last_gate}"
    start_with_env(m, env, "--store", f"s3://{bucket}/p", "--s3-endpoint", endpoint,
                   "--s3-path-style")
    run = m.path / "run"
    run.mkdir()
    step = run / "global_step100"
    step.mkdir()
    # A DCP directory inside the step (one set: its .metadata rename commits it), then the
    # DeepSpeed files, each its own set, then `latest` (outside the step).
    dcp.save({"t": torch.arange(1000.0)}, checkpoint_id=str(step / "dcp_extra"))
    names = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(3)]
    names.append("mp_rank_00_model_states.pt")
    for i, name in enumerate(names):
        torch.save({"w": torch.full((64, 64), float(i))}, step / name)
    (run / "latest").write_text("global_step100")
    rel = "run/global_step100"
    want = {f"{rel}/{n}" for n in names} | {f"{rel}/dcp_extra"}
    wait_for(lambda: set(sets_under(m, rel)) == want, timeout=60, what="every set committed")
    assert all(st in ("committed", "uploading") for st in sets_under(m, rel).values())

    waiter = subprocess.Popen(ckptfs_cmd("wait", str(step)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=REPO)
    api: dict = {}
    t = threading.Thread(target=lambda: api.update(ckptfs.wait_durable(step, timeout=300)))
    t.start()
    try:
        wait_for(lambda: waiting(m, rel, 2), timeout=60, what="both waits to take stock")
        one_line(cli_wait(step, "--timeout", "0.5"), EXIT_STORE,
                 "not durable after 0.5s", "5 of 5 set(s) still pending")
        with pytest.raises(ckptfs.NotDurable) as ei:
            ckptfs.wait_durable(step, timeout=0)
        assert ei.value.state == "timeout" and ei.value.code == EXIT_STORE

        data_gate.unlink()  # every set but the last one's manifest goes through
        wait_for(lambda: sum(st == "durable" for st in sets_under(m, rel).values()) == 4,
                 timeout=120, what="all but the last set durable")
        assert sets_under(m, rel)[last] != "durable"
        one_line(cli_wait(step, "--timeout", "0"), EXIT_STORE,
                 f"1 of 5 set(s) still pending ({last})")
        assert waiter.poll() is None and t.is_alive()  # both still waiting

        last_gate.unlink()
        out, err = waiter.communicate(timeout=120)
        t.join(120)
    finally:
        data_gate.unlink(missing_ok=True)
        last_gate.unlink(missing_ok=True)
        if waiter.poll() is None:
            waiter.kill()
        t.join(120)
    assert waiter.returncode == EXIT_OK, err
    assert out.strip() == f"ckptfs: {step}: 5 sets durable"
    assert api == {"state": "durable", "path": rel, "sets": 5}
    # The reader's side: every one of those sets is in the store the moment wait returned.
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=f"p/manifests/{rel}/")
            .get("Contents", [])}
    assert keys == {f"p/manifests/{p}.json" for p in want}
    # A path inside one set still answers for that set, as before.
    res = cli_wait(step / "dcp_extra", "--timeout", "60")
    assert res.returncode == EXIT_OK and "is durable (set " in res.stdout, res.stderr
    res = cli_wait(step / names[0], "--timeout", "60")
    assert res.returncode == EXIT_OK and f"{rel}/{names[0]} is durable (set " in res.stdout
    # The mount root is a directory like any other: every set in the mount (`latest` too).
    wait_for(lambda: sets_under(m, "run/latest").get("run/latest") == "durable", timeout=60,
             what="latest to be durable")
    res = cli_wait(m.path, "--timeout", "60")
    assert res.returncode == EXIT_OK and res.stdout.strip() == f"ckptfs: {m.path}: 6 sets durable"
    assert not m.unexpected_errors()


def test_wait_dir_with_no_committed_set_exits_8(mnt):
    one_line(cli_wait(mnt.path), EXIT_NO_SET, "/ holds no committed set")
    empty = mnt.path / "empty"
    empty.mkdir()
    one_line(cli_wait(empty), EXIT_NO_SET, "empty holds no committed set")
    with pytest.raises(ckptfs.NotDurable) as ei:
        ckptfs.wait_durable(empty)
    assert ei.value.state == "none" and ei.value.code == EXIT_NO_SET
    # Only subdirectories, no files: nothing committed either.
    (empty / "a" / "b").mkdir(parents=True)
    one_line(cli_wait(empty, "--timeout", "5"), EXIT_NO_SET, "holds no committed set")
    # A path that does not exist: as before.
    one_line(cli_wait(mnt.path / "nope"), EXIT_NO_SET, "not in any committed set")


def test_wait_dir_never_answers_0_with_a_file_in_no_set(mnt):
    """A closed file nothing will commit (a torch.save temporary left behind, a DCP directory
    whose .metadata never came) makes the directory not durable: exit 8 at once, naming it,
    even though every set in the directory is durable."""
    step = mnt.path / "global_step7"
    names = deepspeed_step(step, 2)
    for n in names:
        assert ckptfs.wait_durable(step / n, timeout=60)["state"] == "durable"
    assert ckptfs.wait_durable(step, timeout=60)["sets"] == 3
    (step / "optim.pt.tmp").write_bytes(b"x" * 100)
    shard = step / "model"
    shard.mkdir()
    (shard / "__0_0.distcp").write_bytes(b"y" * 100)
    line = one_line(cli_wait(step, "--timeout", "60"), EXIT_NO_SET,
                    "global_step7 holds 2 file(s) in no committed set",
                    "global_step7/model/__0_0.distcp", "global_step7/optim.pt.tmp")
    assert "not durable" in line
    with pytest.raises(ckptfs.NotDurable) as ei:
        ckptfs.wait_durable(step, timeout=60)
    assert ei.value.state == "uncommitted" and ei.value.code == EXIT_NO_SET
    # Removing them makes the answer 0 again.
    os.unlink(step / "optim.pt.tmp")
    os.unlink(shard / "__0_0.distcp")
    res = cli_wait(step, "--timeout", "60")
    assert res.returncode == EXIT_OK and res.stdout.strip() == f"ckptfs: {step}: 3 sets durable"


def test_wait_dir_waits_for_a_file_open_for_writing(mnt):
    """A file open for writing at the call is part of the directory: the wait waits for its
    close (and its set) within the timeout, and says so on timeout; a file closed in no set
    ends the wait with exit 8."""
    step = mnt.path / "global_step9"
    deepspeed_step(step, 1)
    f = open(step / "mp_rank_01_model_states.pt", "wb")  # noqa: SIM115 (held open across the wait)
    try:
        f.write(b"z" * 4096)
        f.flush()
        one_line(cli_wait(step, "--timeout", "0.5"), EXIT_STORE, "not durable after 0.5s",
                 "1 file(s) still open for writing (global_step9/mp_rank_01_model_states.pt)")
        waiter = start_wait(mnt, step, "global_step9")
        assert waiter.poll() is None
    finally:
        f.close()  # commits it: the wait now waits for its set too
    out, err = waiter.communicate(timeout=120)
    assert waiter.returncode == EXIT_OK, err
    assert out.strip() == f"ckptfs: {step}: 3 sets durable"

    # Open at the call, then closed under a temporary name: nothing commits it.
    g = open(step / "rank3.pt.tmp", "wb")  # noqa: SIM115 (held open across the wait)
    try:
        g.write(b"t" * 10)
        waiter = start_wait(mnt, step, "global_step9")
        assert waiter.poll() is None
    finally:
        g.close()
    out, err = waiter.communicate(timeout=120)
    assert waiter.returncode == EXIT_NO_SET, (out, err)
    assert "global_step9/rank3.pt.tmp was closed but is in no committed set" in err, err


def test_wait_dir_fails_when_a_set_is_deleted_or_failed(held):
    """A set counted by the wait that is removed before it is durable ends the wait with exit
    1 (its local copy is the only one: `wait && rm -rf` must not go on); a failed set in the
    directory fails the wait at once."""
    m, gate = held
    try:
        step = m.path / "global_step3"
        names = deepspeed_step(step, 2)
        waiter = start_wait(m, step, "global_step3")
        os.unlink(step / names[0])
        out, err = waiter.communicate(timeout=120)
        assert waiter.returncode == EXIT_ERROR, (out, err)
        assert f"global_step3/{names[0]} is deleted" in err and "deleted through the mount" \
            in err, err
        # Renamed away (out of the directory) counts the same: it is no longer under DIR.
        waiter = start_wait(m, step, "global_step3")
        os.rename(step / names[1], m.path / "moved.pt")
        out, err = waiter.communicate(timeout=120)
        assert waiter.returncode == EXIT_ERROR, (out, err)
        assert f"global_step3/{names[1]} is deleted" in err and "no longer in the mount" in err \
            and "moved.pt" in err, err
    finally:
        gate.unlink()
    m.stop()

    # A file the store can never hold (over S3's largest object) fails its set at once.
    m.start()
    big = m.path / "global_step4"
    deepspeed_step(big, 1)
    with open(big / "huge.bin", "wb") as f:
        f.truncate(10 << 40)  # a hole: no block written
    wait_for(lambda: sets_under(m, "global_step4").get("global_step4/huge.bin") == "failed",
             timeout=60, what="the huge file's set to fail")
    one_line(cli_wait(big, "--timeout", "60"), EXIT_ERROR,
             "set global_step4/huge.bin is failed", "cannot be stored")
    assert not m.unexpected_errors()


def test_wait_dir_follows_rewrites_and_a_directory_commit_above(held):
    """Sets the wait counted that are replaced while it waits: a file rewritten (its set
    superseded) is waited for until its close commits it again; per-rank sets absorbed by a
    `ckptfs commit` of their directory are followed to that directory's set, which is what the
    wait then counts."""
    m, gate = held
    try:
        run = m.path / "run"
        run.mkdir()
        names = deepspeed_step(run / "step", 1)
        waiter = start_wait(m, run, "run")
        assert f"wait run: {len(names)} set(s) committed under it" in m.log_text()
        new = {"w": torch.zeros(128, 128)}
        torch.save(new, run / "step" / names[0])  # a rewrite, before its upload
        assert sets_under(m, f"run/step/{names[0]}")[f"run/step/{names[0]}"] in (
            "committed", "uploading")
        res = run_cli("commit", str(run / "step"))
        assert res.returncode == EXIT_OK, res.stderr
        assert waiter.poll() is None
    finally:
        gate.unlink()
    out, err = waiter.communicate(timeout=120)
    assert waiter.returncode == EXIT_OK, err
    assert out.strip() == f"ckptfs: {run}: 1 set durable"
    st = sets_under(m, "run")
    assert st["run/step"] == "durable", st
    back = torch.load(run / "step" / names[0])
    assert torch.equal(back["w"], new["w"])
    assert not m.unexpected_errors()


def test_wait_dir_a_rewritten_file_that_no_close_commits_ends_the_wait(held):
    """A file set the wait counted, superseded by a rewrite of its file: the wait waits for the
    file's next close; when that close commits nothing (the directory became a DCP directory
    meanwhile, an open set), the wait ends with exit 8 naming the file, not with a timeout."""
    m, gate = held
    try:
        step = m.path / "global_step5"
        names = deepspeed_step(step, 1)
        waiter = start_wait(m, step, "global_step5", "300")
        (step / ".metadata.tmp").write_bytes(b"")  # a DCP directory now: closes commit nothing
        with open(step / names[0], "r+b") as f:
            f.write(b"\0")
        out, err = waiter.communicate(timeout=120)
    finally:
        gate.unlink()
    assert waiter.returncode == EXIT_NO_SET, (out, err)
    assert f"global_step5/{names[0]} was closed but is in no committed set" in err, err
