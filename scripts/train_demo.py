#!/usr/bin/env python3
"""The ckptfs demo: a training run checkpointing into ckptfs survives `kill -9` of the trainer and
of the filesystem daemon, and resumes bit-exactly; then a new node (a fresh mount with an empty
cache on the same object store) sees every checkpoint and resumes training from the store.

Two roles in one file:

  train_demo.py [demo] [--work DIR]      the driver (default): mounts ckptfs, runs, kills and
                                         resumes the trainer, kills the daemon, verifies, unmounts,
                                         then resumes on a new node from the store
  train_demo.py train --ckpt-dir D ...   the training program: an ordinary deterministic CPU
                                         training loop that checkpoints every N steps with
                                         torch.save (tmp + os.replace + `latest` symlink) and
                                         with PyTorch DCP (dcp/step_<N>)

The trainer records a sha256 of every state it saves (weights, Adam state, RNG state, step) in a
JSON-lines file outside the mount. The hash is computed from the live model and optimizer, so the
same state loaded from torch.save or from DCP hashes the same.

Exit status: 0 when every check passed, 1 when any failed (the reason is printed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch
    from torch import nn

# a JSON record (records.jsonl) or a checkpoint's state dict
Json = dict[str, Any]
T = TypeVar("T")
# a trainer: its process, the thread copying its output, the lines so far
TrainerRun = tuple["subprocess.Popen[str]", threading.Thread, list[str]]

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/ckpt_restore.py

# DCP says so on every save/load without a process group; single-process use is intended here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")

# ----------------------------------------------------------------------------------------------
# the training program


def build(seed: int = 0) -> tuple[nn.Sequential, torch.optim.Adam]:
    import torch
    from torch import nn

    torch.manual_seed(seed)
    # ~1.6 M parameters: 6.3 MB of fp32 weights, ~19 MB per checkpoint with the Adam moments.
    model = nn.Sequential(
        nn.Linear(512, 1024), nn.ReLU(), nn.Dropout(0.1),
        nn.Linear(1024, 1024), nn.ReLU(), nn.Dropout(0.1),
        nn.Linear(1024, 10),
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, opt


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of one step, generated from a per-step seed (a resumed run sees the same data)."""
    import torch

    g = torch.Generator().manual_seed(1_000_003 * step + 17)
    x = torch.randn(64, 512, generator=g)
    y = torch.randint(0, 10, (64,), generator=g)
    return x, y


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    import torch

    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data


def state_hash(model: nn.Module, opt: torch.optim.Optimizer, rng: torch.Tensor, step: int
               ) -> str:
    """sha256 over everything a resume depends on, in a canonical order (parameter names, not
    the optimizer's integer ids): identical for a state loaded from torch.save or from DCP."""
    import torch

    h = hashlib.sha256(f"step={int(step)}\n".encode())

    def add(label: str, v: object) -> None:
        if isinstance(v, torch.Tensor):
            h.update(f"{label}:{v.dtype}:{tuple(v.shape)}\n".encode())
            h.update(_tensor_bytes(v))
        else:
            h.update(f"{label}={v!r}\n".encode())

    for name, p in model.named_parameters():
        add(f"param.{name}", p)
    for name, b in model.named_buffers():
        add(f"buffer.{name}", b)
    for name, p in model.named_parameters():
        st = opt.state.get(p, {})
        for k in sorted(st):
            add(f"optim.{name}.{k}", st[k])
    for i, group in enumerate(opt.param_groups):
        for k in sorted(group):
            if k != "params":
                add(f"group{i}.{k}", group[k])
    add("rng", rng)
    return h.hexdigest()


def _read_records(path: Path) -> dict[int, Json]:
    out: dict[int, Json] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                out[r["step"]] = r
    return out


def _append_record(path: Path, rec: Json) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(ckpt_dir: Path, step: int, model: nn.Module, opt: torch.optim.Optimizer,
                    records: Path) -> str:
    """The careful checkpoint: torch.save to a tmp name, os.replace to the final name, a DCP
    save of the same state, then `latest` switched atomically (a symlink replaced by rename)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rng = torch.get_rng_state()
    final = ckpt_dir / f"step_{step}.pt"
    tmp = ckpt_dir / f"step_{step}.pt.tmp"
    torch.save({"step": step, "model": model.state_dict(), "optim": opt.state_dict(),
                "rng": rng}, tmp)
    os.replace(tmp, final)

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "rng": rng, "step": step},
             checkpoint_id=ckpt_dir / "dcp" / f"step_{step}")

    digest = state_hash(model, opt, rng, step)
    _append_record(records, {"step": step, "sha256": digest})

    link_tmp = ckpt_dir / "latest.tmp"
    link_tmp.unlink(missing_ok=True)  # left over if a previous run died between the two calls
    os.symlink(final.name, link_tmp)
    os.replace(link_tmp, ckpt_dir / "latest")
    return digest


def _same_state(m1: nn.Module, o1: torch.optim.Optimizer, m2: nn.Module,
                o2: torch.optim.Optimizer) -> list[str]:
    import torch

    bad = []
    p2 = dict(m2.named_parameters())
    for name, p in m1.named_parameters():
        q = p2[name]
        if p.dtype != q.dtype or not torch.equal(p, q):
            bad.append(f"param {name}")
        s1, s2 = o1.state.get(p, {}), o2.state.get(q, {})
        if set(s1) != set(s2):
            bad.append(f"optim state keys of {name}")
            continue
        for k in s1:
            a, b = s1[k], s2[k]
            if isinstance(a, torch.Tensor):
                if a.dtype != b.dtype or not torch.equal(a, b):
                    bad.append(f"optim {name}.{k}")
            elif a != b:
                bad.append(f"optim {name}.{k}")
    return bad


# (model, optimizer, rng state, step, state_hash) of a loaded checkpoint
Loaded = tuple["nn.Sequential", "torch.optim.Adam", "torch.Tensor", int, str]


def load_checkpoints(ckpt_dir: Path, step: int, torch_file: Path | None = None
                     ) -> tuple[Loaded, Loaded]:
    """Load step `step` from torch.save and from DCP into two fresh model/optimizer pairs.
    Returns ((model, opt, rng, step, hash) for torch.save, the same for DCP)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    m1, o1 = build()
    ck = torch.load(torch_file or ckpt_dir / f"step_{step}.pt", weights_only=True)
    m1.load_state_dict(ck["model"])
    o1.load_state_dict(ck["optim"])
    h1 = state_hash(m1, o1, ck["rng"], ck["step"])

    m2, o2 = build()
    msd, osd = get_state_dict(m2, o2)  # initialises the Adam state DCP loads into in place
    sd: Json = {"model": msd, "optim": osd, "rng": torch.zeros_like(ck["rng"]), "step": -1}
    dcp.load(sd, checkpoint_id=ckpt_dir / "dcp" / f"step_{step}")
    set_state_dict(m2, o2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    h2 = state_hash(m2, o2, sd["rng"], sd["step"])
    return (m1, o1, ck["rng"], ck["step"], h1), (m2, o2, sd["rng"], sd["step"], h2)


def train(a: argparse.Namespace) -> int:
    import torch
    from torch import nn

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    ckpt_dir: Path = a.ckpt_dir
    (ckpt_dir / "dcp").mkdir(parents=True, exist_ok=True)

    model, opt = build()
    start = 0
    if a.resume:
        latest = ckpt_dir / "latest"
        target = os.readlink(latest)
        m = re.fullmatch(r"step_(\d+)\.pt", target)
        if m is None:
            raise ValueError(f"latest names {target!r}, not a step_N.pt")
        step = int(m.group(1))
        records = _read_records(a.records)
        want = records[step]["sha256"]
        (m1, o1, rng1, s1, h1), (m2, o2, rng2, s2, h2) = load_checkpoints(
            ckpt_dir, step, torch_file=latest)
        print(f"resume: latest -> {target}", flush=True)
        print(f"resume: torch.save step {s1}: sha256 {h1[:16]}  recorded at save "
              f"{want[:16]}  {'MATCH' if h1 == want else 'MISMATCH'}", flush=True)
        print(f"resume: DCP dcp/step_{s2}:    sha256 {h2[:16]}  recorded at save "
              f"{want[:16]}  {'MATCH' if h2 == want else 'MISMATCH'}", flush=True)
        diff = _same_state(m1, o1, m2, o2)
        same_rng = torch.equal(rng1, rng2)
        print(f"resume: torch.save vs DCP: "
              f"{'bit-identical' if not diff and same_rng else 'DIFFERENT: ' + str(diff[:5])}",
              flush=True)
        if h1 != want or h2 != want or diff or not same_rng or s1 != step or s2 != step:
            print("resume: FAILED: checkpoint does not match what was saved", flush=True)
            return 3
        model, opt = m1, o1
        torch.set_rng_state(rng1)
        start = step

    model.train()
    for step in range(start + 1, a.steps + 1):
        x, y = batch(step)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        torch.autograd.backward(loss)  # loss.backward(), which torch leaves unannotated
        opt.step()
        print(f"step {step} loss {loss.item():.6f}", flush=True)
        if step % a.every == 0:
            digest = save_checkpoint(ckpt_dir, step, model, opt, a.records)
            print(f"checkpoint step {step} sha256 {digest[:16]}", flush=True)

    final = state_hash(model, opt, torch.get_rng_state(), a.steps)
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, a.final)
    print(f"final step {a.steps} sha256 {final}", flush=True)
    return 0


# ----------------------------------------------------------------------------------------------
# the driver


class Failed(Exception):
    pass


def check(cond: bool, what: str) -> None:
    if not cond:
        raise Failed(what)


def _mounted(path: Path) -> bool:
    from ckptfs.mount import find_mount

    return find_mount(path) is not None


def _alive(pid: int) -> bool:
    from ckptfs.mount import pid_running  # running and not a zombie

    return pid_running(pid)


def wait_until(cond: Callable[[], T], timeout: float, what: str) -> T:
    from procwait import wait_for  # scripts/procwait.py, beside this script

    return wait_for(cond, timeout, what, exc=Failed)


def _file_hashes(root: Path) -> dict[str, str]:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink():
            h = hashlib.sha256()
            with open(p, "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
            out[str(p.relative_to(root))] = h.hexdigest()
    return out


def _prefetch_seconds(out: str) -> float:
    """The time `ckptfs prefetch` reports for its prefetch."""
    m = re.search(r"prefetched \S+: (\d+) files, .* in ([\d.]+)s", out)
    check(m is not None, f"ckptfs prefetch did not report a prefetch: {out!r}")
    assert m is not None
    return float(m.group(2))


def _natural(name: str) -> tuple[int | str, ...]:
    """Sort key: step_9 before step_10."""
    return tuple(int(x) if x.isdigit() else x for x in re.split(r"(\d+)", name))


class Demo:
    TOTAL = 11
    EXTRA_STEPS = 10  # steps the new node trains after resuming from the store

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.work: Path = a.work.absolute()
        self.mnt = self.work / "mnt"
        self.cache = self.work / "cache"
        self.store = self.work / "store"
        self.logs = self.work / "logs"
        self.log_file = self.logs / "ckptfs.log"
        self.ckptfs = Path(sys.executable).parent / "ckptfs"
        self.daemon_pid: int | None = None
        # The new node: its own mount point and an empty cache dir, on the same store.
        self.node2_mnt = self.work / "node2-mnt"
        self.node2_cache = self.work / "node2-cache"
        self.node2_log_file = self.logs / "ckptfs-node2.log"
        self.node2_pid: int | None = None
        self.trainers: list[subprocess.Popen[str]] = []
        self.n = 0

    def say(self, msg: str) -> None:
        self.n += 1
        print(f"[{self.n}/{self.TOTAL}] {msg}", flush=True)

    @staticmethod
    def info(msg: str) -> None:
        print(f"      {msg}", flush=True)

    # -- ckptfs ---------------------------------------------------------------------------

    def _ckptfs_mount(self, mnt: Path, cache: Path, log_file: Path) -> int:
        # The object store lives in the work dir too, so a wiped work dir is a fresh start.
        res = subprocess.run([str(self.ckptfs), "mount", str(mnt), "--cache-dir",
                              str(cache), "--store", f"file://{self.store}",
                              "--log-file", str(log_file)],
                             check=False, capture_output=True, text=True, timeout=120)
        check(res.returncode == 0, f"ckptfs mount of {mnt} failed ({res.returncode}): "
              f"{res.stderr.strip() or res.stdout.strip()}")
        m = re.search(r"pid (\d+)", res.stdout)
        check(m is not None and _mounted(mnt), f"mount did not report a pid: {res.stdout}")
        assert m is not None
        return int(m.group(1))

    def _ckptfs_umount(self, mnt: Path) -> None:
        res = subprocess.run([str(self.ckptfs), "umount", str(mnt)], check=False,
                             capture_output=True, text=True, timeout=300)
        check(res.returncode == 0, f"ckptfs umount of {mnt} failed ({res.returncode}): "
              f"{res.stderr.strip()}")

    def mount(self) -> int:
        self.daemon_pid = self._ckptfs_mount(self.mnt, self.cache, self.log_file)
        return self.daemon_pid

    def umount(self) -> None:
        self._ckptfs_umount(self.mnt)
        self.daemon_pid = None

    def mount_node2(self) -> int:
        self.node2_pid = self._ckptfs_mount(self.node2_mnt, self.node2_cache,
                                            self.node2_log_file)
        return self.node2_pid

    def umount_node2(self) -> None:
        self._ckptfs_umount(self.node2_mnt)
        self.node2_pid = None

    def _force_umount(self, mnt: Path, pid: int | None) -> None:
        """Unmount `mnt` if mounted: cleanly while its daemon lives, else lazily; then make sure
        the daemon `pid` (ours) is gone."""
        if _mounted(mnt):
            if pid is not None and _alive(pid):
                subprocess.run([str(self.ckptfs), "umount", str(mnt)], check=False,
                               capture_output=True, timeout=300)
            if _mounted(mnt):
                subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False,
                               capture_output=True)
        if pid is not None and _alive(pid):
            os.kill(pid, signal.SIGKILL)

    def cleanup(self) -> None:
        """Always runs: stop our trainers, unmount both mounts (lazily if a daemon is dead)."""
        for p in self.trainers:
            if p.poll() is None:
                p.kill()
                p.wait()
        self._force_umount(self.node2_mnt, self.node2_pid)
        self._force_umount(self.mnt, self.daemon_pid)

    def prepare_work_dir(self) -> None:
        # A previous run that was interrupted may have left its mounts behind: unmount them
        # before wiping, or the wipe would delete through a mount (or fail on a dead one).
        for mnt in (self.node2_mnt, self.mnt):
            if _mounted(mnt):
                subprocess.run([str(self.ckptfs), "umount", str(mnt)], check=False,
                               capture_output=True, timeout=300)
                if _mounted(mnt):
                    subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False,
                                   capture_output=True)
                check(not _mounted(mnt), f"{mnt} is still mounted; unmount it first")
        if self.work.exists():
            shutil.rmtree(self.work)
        for d in (self.mnt, self.cache, self.store, self.logs, self.work / "reference"):
            d.mkdir(parents=True)

    # -- trainers -------------------------------------------------------------------------

    def trainer_cmd(self, ckpt_dir: Path, records: Path, final: Path, resume: bool,
                    steps: int | None = None) -> list[str]:
        cmd = [sys.executable, str(Path(__file__).resolve()), "train", "--ckpt-dir",
               str(ckpt_dir), "--records", str(records), "--final", str(final), "--steps",
               str(steps or self.a.steps), "--every", str(self.a.every)]
        return cmd + (["--resume"] if resume else [])

    def start_trainer(self, cmd: list[str], log: Path,
                      on_line: Callable[[subprocess.Popen[str], str], None] | None = None
                      ) -> TrainerRun:
        """Start a trainer; a thread copies its output to `log` and calls `on_line(proc, line)`
        for every line."""
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             cwd=self.work, bufsize=1)
        self.trainers.append(p)
        lines: list[str] = []

        def pump() -> None:
            assert p.stdout is not None  # stdout=PIPE
            with open(log, "w") as f:
                for line in p.stdout:
                    f.write(line)
                    f.flush()
                    lines.append(line.rstrip("\n"))
                    if on_line is not None:
                        on_line(p, line)

        t = threading.Thread(target=pump, daemon=True)
        t.start()
        return p, t, lines

    def finish(self, p: subprocess.Popen[str], t: threading.Thread, lines: list[str], log: Path,
               what: str) -> list[str]:
        rc = p.wait(timeout=600)
        t.join(timeout=30)
        if rc != 0:
            tail = "\n".join("      | " + ln for ln in lines[-15:])
            raise Failed(f"{what} exited with {rc}; log {log}:\n{tail}")
        return lines

    # -- the demo -------------------------------------------------------------------------

    def run(self) -> None:
        a = self.a
        check(self.ckptfs.exists(), f"{self.ckptfs} not found: run scripts/setup.sh first")
        self.prepare_work_dir()
        pid = self.mount()
        run_dir = self.mnt / "run"
        run_dir.mkdir()
        self.say(f"mounted ckptfs at {self.mnt} (cache {self.cache}, store {self.store}, "
                 f"daemon pid {pid})")

        # The reference (uninterrupted, on the plain disk) runs alongside the first attempt.
        ref_dir = self.work / "reference" / "ckpt"
        ref_records = self.work / "reference" / "records.jsonl"
        ref_final = self.work / "reference" / "final.pt"
        ref = self.start_trainer(self.trainer_cmd(ref_dir, ref_records, ref_final, False),
                                 self.logs / "reference.log")

        records = self.work / "records.jsonl"
        final = self.work / "final.pt"
        progress = {"step": 0}
        killed = threading.Event()
        state: Json = {}

        def on_line(proc: subprocess.Popen[str], line: str) -> None:
            m = re.match(r"step (\d+) ", line)
            if not m or killed.is_set():
                return
            progress["step"] = int(m.group(1))
            if progress["step"] >= a.kill_at:
                proc.kill()  # SIGKILL, right as the step is reported
                state["step"] = progress["step"]
                killed.set()

        p1, t1, lines1 = self.start_trainer(self.trainer_cmd(run_dir, records, final, False),
                                            self.logs / "train-1.log", on_line)
        self.say(f"started trainer (pid {p1.pid}) in the mount: {a.steps} steps, torch.save + "
                 f"DCP checkpoint every {a.every} steps")
        rc = p1.wait(timeout=600)
        t1.join(timeout=30)
        check(killed.is_set(), f"trainer exited ({rc}) before it could be killed at step "
              f"{a.kill_at}; log {self.logs / 'train-1.log'}")
        check(rc == -signal.SIGKILL, f"trainer exit status {rc}, expected SIGKILL")
        saved = [int(m.group(1)) for ln in lines1
                 if (m := re.match(r"checkpoint step (\d+) ", ln))]
        latest = run_dir / "latest"
        m = re.fullmatch(r"step_(\d+)\.pt", os.readlink(latest)) if latest.is_symlink() else None
        latest_step = int(m.group(1)) if m else None
        self.say(f"killed trainer (pid {p1.pid}) with SIGKILL at step {state['step']}; latest "
                 f"checkpoint: step {latest_step} (saved so far: {saved})")
        check(latest_step is not None and latest_step >= a.every,
              "no checkpoint was complete when the trainer was killed")
        leftovers = sorted(p.name for p in run_dir.iterdir() if p.name.endswith(".tmp"))
        self.info(f"{run_dir}: latest -> {os.readlink(latest)}; "
                  f"unfinished tmp files: {leftovers or 'none'}")

        p2 = self.start_trainer(self.trainer_cmd(run_dir, records, final, True),
                                self.logs / "train-2.log")
        lines2 = self.finish(*p2, self.logs / "train-2.log", "resumed trainer")
        first = next(int(m.group(1)) for ln in lines2 if (m := re.match(r"step (\d+) ", ln)))
        self.say(f"restarted trainer with --resume (pid {p2[0].pid}); it verified the "
                 f"checkpoint, continued at step {first} and ran to step {a.steps}:")
        for ln in lines2:
            if ln.startswith("resume:"):
                self.info(ln)
        assert latest_step is not None  # checked above
        check(first == latest_step + 1, f"resumed at step {first}, expected {latest_step + 1}")
        check(any("torch.save vs DCP: bit-identical" in ln for ln in lines2),
              "resume did not show torch.save and DCP bit-identical")
        check(sum("MATCH" in ln and "MISMATCH" not in ln for ln in lines2) == 2,
              "resume hashes did not match the recorded ones")

        ref_lines = self.finish(*ref, self.logs / "reference.log", "reference trainer")
        final_line = [ln for ln in lines2 if ln.startswith("final ")][-1]
        ref_final_line = [ln for ln in ref_lines if ln.startswith("final ")][-1]
        got, want = final_line.split()[-1], ref_final_line.split()[-1]
        check(got == want, f"final state {got[:16]} != reference {want[:16]}")
        self._compare_final(final, ref_final)
        run_recs, ref_recs = _read_records(records), _read_records(ref_records)
        check(set(run_recs) == set(ref_recs), f"checkpoints {sorted(run_recs)} vs reference "
              f"{sorted(ref_recs)}")
        bad = [s for s in run_recs if run_recs[s]["sha256"] != ref_recs[s]["sha256"]]
        check(not bad, f"checkpoints differing from the reference run: {bad}")
        self.say(f"final weights + Adam state after step {a.steps} are bit-identical to an "
                 f"uninterrupted reference run on the plain disk (sha256 {got[:16]}); so are "
                 f"all {len(run_recs)} checkpoints")

        expected_files = _file_hashes(run_dir)
        expected_latest = os.readlink(run_dir / "latest")
        old_pid = self.daemon_pid
        assert old_pid is not None  # mounted
        os.kill(old_pid, signal.SIGKILL)
        wait_until(lambda: not _alive(old_pid), 30, "the daemon to die")
        self.daemon_pid = None
        try:
            os.listdir(self.mnt)  # opendir always reaches the daemon (a stat may be cached)
            dead = "still answering?!"
        except OSError as e:
            dead = f"mount now answers {e.strerror}"
        check(dead != "still answering?!", "mount answered after its daemon was killed")
        self.say(f"killed the ckptfs daemon (pid {old_pid}) with SIGKILL ({dead})")

        new_pid = self.mount()
        self.say(f"remounted the same cache dir (daemon pid {new_pid})")
        files = _file_hashes(run_dir)
        check(set(files) == set(expected_files),
              f"files changed: missing {sorted(set(expected_files) - set(files))}, extra "
              f"{sorted(set(files) - set(expected_files))}")
        bad_files = sorted(k for k in files if files[k] != expected_files[k])
        check(not bad_files, f"files whose bytes changed: {bad_files}")
        check(os.readlink(run_dir / "latest") == expected_latest, "latest symlink changed")
        for step in sorted(run_recs):
            (_, _, _, _, h1), (_, _, _, _, h2) = load_checkpoints(run_dir, step)
            want = run_recs[step]["sha256"]
            check(h1 == want, f"torch.save checkpoint step {step}: sha256 {h1[:16]} != "
                  f"recorded {want[:16]}")
            check(h2 == want, f"DCP checkpoint step {step}: sha256 {h2[:16]} != recorded "
                  f"{want[:16]}")
        self.info(f"{len(files)} files, byte-identical to before the crash; latest -> "
                  f"{expected_latest}")
        self.info(f"all {len(run_recs)} torch.save and {len(run_recs)} DCP checkpoints "
                  f"(steps {min(run_recs)}..{max(run_recs)}) load with the sha256 recorded at "
                  f"save time")

        self.tiering(run_dir, run_recs)

        expected_sizes = {k: (run_dir / k).stat().st_size for k in files}
        self.umount()
        self.say(f"unmounted {self.mnt}")

        self.new_node(run_recs, expected_sizes, expected_latest, records, ref_dir, ref_records)

    def tiering(self, run_dir: Path, run_recs: dict[int, Json]) -> None:
        """Every checkpoint becomes durable in the object store; the newest one restores from
        the store with plain tools (no ckptfs) bit-exactly."""
        from ckpt_restore import FileStoreView, manifests, restore_to

        import ckptfs

        newest = max(run_recs)
        t0 = time.monotonic()
        for path in (run_dir / f"step_{newest}.pt", run_dir / "dcp" / f"step_{newest}",
                     run_dir / "latest"):
            ckptfs.wait_durable(path, timeout=300)
        st = ckptfs.status(self.mnt)["tiering"]
        states: dict[str, int] = {}
        for x in st["sets"]:
            states[x["state"]] = states.get(x["state"], 0) + 1
        self.say(f"every checkpoint is durable in the object store {self.store} "
                 f"({time.monotonic() - t0:.1f}s of waiting after the remount); sets by state: "
                 f"{dict(sorted(states.items()))}, store health {st['store']['health']}")
        for x in st["sets"][-3:]:
            self.info(f"set {x['seq']:>3} {x['state']:<8} {x['files']:>3} files "
                      f"{x['bytes']:>10} bytes  {x['path']}")
        view = FileStoreView(self.store)
        published = manifests(view)
        want = {f"run/step_{s}.pt" for s in run_recs} | {f"run/dcp/step_{s}" for s in run_recs}
        check(want <= set(published), f"sets missing from the store: "
              f"{sorted(want - set(published))}")
        restored = self.work / "restored"
        for sp in (f"run/step_{newest}.pt", f"run/dcp/step_{newest}"):
            restore_to(view, published[sp], restored)
        (_, _, _, _, h1), (_, _, _, _, h2) = load_checkpoints(restored / "run", newest)
        check(h1 == h2 == run_recs[newest]["sha256"], f"checkpoint {newest} restored from the "
              f"store: sha256 {h1[:16]}/{h2[:16]} != recorded {run_recs[newest]['sha256'][:16]}")
        self.info(f"step {newest} restored from the store without ckptfs "
                  f"(scripts/ckpt_restore.py: manifests, objects, CRC32C): torch.save and DCP "
                  f"sha256 {h1[:16]} match the ones recorded at save time")

    def new_node(self, run_recs: dict[int, Json], expected_sizes: dict[str, int],
                 expected_latest: str, records: Path, ref_dir: Path, ref_records: Path) -> None:
        """A new node: a fresh mount with an empty cache dir on the same store shows every
        committed checkpoint (from the store's manifests), prefetches the newest DCP checkpoint
        and resumes training from the store, bit-identically to the reference run resumed from
        its own checkpoint on the plain disk."""
        from ckpt_restore import FileStoreView, manifests

        import ckptfs

        a = self.a
        newest = max(run_recs)
        target = a.steps + self.EXTRA_STEPS
        # The reference resumes from its own step-`newest` checkpoint on the plain disk; it
        # starts now so that it runs while the new node mounts.
        ref_final = self.work / "reference" / f"final-{target}.pt"
        ref = self.start_trainer(self.trainer_cmd(ref_dir, ref_records, ref_final, True, target),
                                 self.logs / "reference-resume.log")
        check(not self.node2_cache.exists(), f"{self.node2_cache} exists: not an empty cache")
        self.node2_cache.mkdir()
        self.node2_mnt.mkdir()
        pid = self.mount_node2()
        run2 = self.node2_mnt / "run"
        want_pt = {f"step_{s}.pt" for s in run_recs}
        want_dcp = {f"step_{s}" for s in run_recs}
        seen: Json = {}

        def visible() -> bool:
            try:
                seen["run"] = set(os.listdir(run2))
                seen["dcp"] = set(os.listdir(run2 / "dcp"))
            except FileNotFoundError:
                return False
            return want_pt <= seen["run"] and "latest" in seen["run"] and want_dcp <= seen["dcp"]

        t0 = time.monotonic()
        try:
            wait_until(visible, 60, f"the store's checkpoints to appear in {run2}")
        except Failed as e:
            raise Failed(f"{e}; it lists {sorted(seen.get('run', []), key=_natural)}, dcp/ "
                         f"{sorted(seen.get('dcp', []), key=_natural)}; daemon log "
                         f"{self.node2_log_file}") from None
        t_visible = time.monotonic() - t0
        n_pt = sum(1 for n in seen["run"] if re.fullmatch(r"step_\d+\.pt", n))
        n_dcp = sum(1 for n in seen["dcp"] if re.fullmatch(r"step_\d+", n))
        latest2 = os.readlink(run2 / "latest")
        check(latest2 == expected_latest, f"node 2: latest -> {latest2}, expected "
              f"{expected_latest}")
        bad_sizes = sorted(k for k, size in expected_sizes.items()
                           if not (run2 / k).is_file() or (run2 / k).stat().st_size != size)
        check(not bad_sizes, f"node 2: files missing or with another size: {bad_sizes}")
        st = ckptfs.status(self.node2_mnt)
        cache_before = st["cache"]["cached_bytes"]
        fetched_before = st["tiering"]["restore"]["bytes_fetched"]

        dcp_rel = f"run/dcp/step_{newest}"
        res = subprocess.run([str(self.ckptfs), "prefetch", str(self.node2_mnt / dcp_rel)],
                             check=False, capture_output=True, text=True, timeout=300)
        out = res.stdout.strip()
        check(res.returncode == 0, f"ckptfs prefetch {dcp_rel} failed ({res.returncode}): "
              f"{res.stderr.strip() or out}")
        secs = _prefetch_seconds(out)
        dcp_bytes = sum(size for k, size in expected_sizes.items()
                        if k.startswith(f"dcp/step_{newest}/"))
        took = f"{dcp_bytes / 1e6:.1f} MB in {secs:.1f} s" + (
            f", {dcp_bytes / 1e6 / secs:.0f} MB/s" if secs > 0 else "")
        st = ckptfs.status(self.node2_mnt)
        cache_after = st["cache"]["cached_bytes"]
        fetched = st["tiering"]["restore"]["bytes_fetched"] - fetched_before
        check(cache_before == 0, f"node 2's new cache held {cache_before} bytes of file data "
              f"before anything was read")
        check(cache_after >= dcp_bytes and fetched >= dcp_bytes, f"after the prefetch of "
              f"{dcp_rel} ({dcp_bytes} bytes) node 2's cache holds {cache_after} bytes, "
              f"{fetched} fetched from the store")
        self.say(f"new node: mounted {self.node2_mnt} with an empty cache "
                 f"({self.node2_cache}) on the same store (daemon pid {pid}): {n_pt} torch.save "
                 f"+ {n_dcp} DCP checkpoints visible; prefetched {dcp_rel} ({took})")
        self.info(f"{run2}: {sorted(seen['run'], key=_natural)}")
        self.info(f"{run2 / 'dcp'}: {sorted(seen['dcp'], key=_natural)}")
        self.info(f"latest -> {latest2}; all {len(expected_sizes)} files listed with the sizes "
                  f"they had on the first node ({t_visible:.1f}s after the mount)")
        self.info(f"$ ckptfs prefetch {self.node2_mnt / dcp_rel}")
        self.info(f"{out}")
        self.info(f"node 2's cache held {cache_before:,} bytes of file data before the "
                  f"prefetch, {cache_after:,} after ({fetched:,} bytes fetched from the store)")

        # Resume on the new node from the store (the reference is already resuming).
        n2_records = self.work / "node2-records.jsonl"
        shutil.copyfile(records, n2_records)  # the hashes recorded at save time come along
        n2_final = self.work / "node2-final.pt"
        p3 = self.start_trainer(self.trainer_cmd(run2, n2_records, n2_final, True, target),
                                self.logs / "train-node2.log")
        lines3 = self.finish(*p3, self.logs / "train-node2.log", "trainer on the new node")
        ref_lines = self.finish(*ref, self.logs / "reference-resume.log",
                                "resumed reference trainer")
        steps3 = [int(m.group(1)) for ln in lines3 if (m := re.match(r"step (\d+) ", ln))]
        check(steps3 == list(range(newest + 1, target + 1)), f"node 2 ran steps "
              f"{steps3[:1]}..{steps3[-1:]}, expected {newest + 1}..{target}")
        check(any(ln == f"resume: latest -> step_{newest}.pt" for ln in lines3),
              f"node 2 did not resume from step_{newest}.pt")
        check(any("torch.save vs DCP: bit-identical" in ln for ln in lines3),
              "node 2: resume did not show torch.save and DCP bit-identical")
        check(sum("MATCH" in ln and "MISMATCH" not in ln for ln in lines3) == 2,
              "node 2: resume hashes did not match the recorded ones")
        got = [ln for ln in lines3 if ln.startswith("final ")][-1].split()[-1]
        want = [ln for ln in ref_lines if ln.startswith("final ")][-1].split()[-1]
        check(got == want, f"node 2 final state {got[:16]} != reference {want[:16]}")
        self._compare_final(n2_final, ref_final)
        n2_recs, ref_recs = _read_records(n2_records), _read_records(ref_records)
        new_ckpts = [s for s in n2_recs if s > newest]
        check(new_ckpts == [s for s in ref_recs if s > newest], f"node 2 saved checkpoints "
              f"{new_ckpts}, the reference {[s for s in ref_recs if s > newest]}")
        bad = [s for s in new_ckpts if n2_recs[s]["sha256"] != ref_recs[s]["sha256"]]
        check(not bad, f"node 2 checkpoints differing from the reference: {bad}")
        self.say(f"resumed from the store on the new node (trainer pid {p3[0].pid}): it verified "
                 f"step {newest} (torch.save + DCP), trained steps {newest + 1}..{target} in "
                 f"{run2}; the final state is bit-identical to the reference resumed on the "
                 f"plain disk (sha256 {got[:16]})" + (
                     f", and so are its checkpoints {new_ckpts}" if new_ckpts else ""))
        for ln in lines3:
            if ln.startswith("resume:"):
                self.info(ln)

        self.umount_node2()
        published = manifests(FileStoreView(self.store))
        for s in new_ckpts:
            check(f"run/step_{s}.pt" in published and f"run/dcp/step_{s}" in published,
                  f"node 2's checkpoint {s} is not in the store after its unmount")
        self.info(f"unmounted {self.node2_mnt}" + (
            f"; its checkpoint{'s' if len(new_ckpts) > 1 else ''} "
            f"{', '.join(f'step {s}' for s in new_ckpts)} went to the store too "
            f"({len(published)} sets published)" if new_ckpts else ""))

    def _compare_final(self, final: Path, ref_final: Path) -> None:
        import torch

        a = torch.load(final, weights_only=True)
        b = torch.load(ref_final, weights_only=True)

        _same_final(a, b, "state")


def _same_final(x: object, y: Any, path: str) -> None:
    """The final state of the run `x` equals the reference's `y`, tensor by tensor."""
    import torch

    if isinstance(x, torch.Tensor):
        check(x.dtype == y.dtype and torch.equal(x, y), f"final {path} differs")
    elif isinstance(x, dict):
        check(set(x) == set(y), f"final {path}: keys differ")
        for k in x:
            _same_final(x[k], y[k], f"{path}.{k}")
    elif isinstance(x, list):
        check(len(x) == len(y), f"final {path}: lengths differ")
        for i, (u, v) in enumerate(zip(x, y)):
            _same_final(u, v, f"{path}[{i}]")
    else:
        check(x == y, f"final {path} differs")


def _preimport_torch() -> None:
    # The driver needs torch only to verify checkpoints; importing it takes seconds, so do it
    # while the trainers run.
    def imp() -> None:
        try:
            import torch.distributed.checkpoint  # noqa: F401
        except Exception:  # noqa: BLE001, S110 -- the real import later reports the problem
            pass

    threading.Thread(target=imp, daemon=True).start()


def _terminate_on_sigterm() -> None:
    # SIGTERM (e.g. a CI timeout) must still run the `finally` that unmounts.
    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def demo(a: argparse.Namespace) -> int:
    t0 = time.monotonic()
    _terminate_on_sigterm()
    _preimport_torch()
    print(f"ckptfs demo: a training run that survives kill -9 of the trainer and of the "
          f"filesystem daemon (work dir {a.work})", flush=True)
    d = Demo(a)
    try:
        d.run()
    except Failed as e:
        print(f"FAILED: {e}", flush=True)
        print(f"        logs: {d.logs}", flush=True)
        return 1
    except Exception as e:  # noqa: BLE001 -- still unmount, and say what broke
        print(f"FAILED: unexpected {e.__class__.__name__}: {e}", flush=True)
        print(f"        logs: {d.logs}", flush=True)
        return 1
    except KeyboardInterrupt as e:
        print(f"FAILED: interrupted ({e or 'SIGINT'}); cleaning up", flush=True)
        return 130
    finally:
        d.cleanup()
    print(f"PASSED: every check held ({time.monotonic() - t0:.0f}s)", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in ("demo", "train", "-h", "--help"):
        argv = ["demo", *argv]  # the demo is the default command
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="run the demo (the default)")
    d.add_argument("--work", type=Path, default=Path("demo-work"),
                   help="work dir, wiped at start (default ./demo-work)")
    d.add_argument("--steps", type=int, default=100)
    d.add_argument("--every", type=int, default=10, help="checkpoint interval in steps")
    d.add_argument("--kill-at", type=int, default=47,
                   help="SIGKILL the trainer once it reports this step (default 47)")
    t = sub.add_parser("train", help="the training program")
    t.add_argument("--ckpt-dir", type=Path, required=True)
    t.add_argument("--records", type=Path, required=True,
                   help="JSON lines: the sha256 of every saved state (keep it outside the mount)")
    t.add_argument("--final", type=Path, required=True, help="where to save the final state")
    t.add_argument("--steps", type=int, default=100)
    t.add_argument("--every", type=int, default=10)
    t.add_argument("--resume", action="store_true", help="resume from <ckpt-dir>/latest")
    a = p.parse_args(argv)
    if a.cmd == "train":
        return train(a)
    if not (a.every <= a.kill_at < a.steps):
        d.error("need --every <= --kill-at < --steps")
    return demo(a)


if __name__ == "__main__":
    sys.exit(main())
