"""The trainer of scripts/fault_loop.py: one rank of a subprocess
(`fault_loop.py trainer RANK WORLD INIT MOUNT SEED`) that saves, rotates and loads checkpoints
through a ckptfs mount on command. Commands come on stdin as JSON lines, events go to stdout,
one per line:

  B <path> <step>   a save/commit of path begins        W <path>   paused mid-write/delete
  H <path> <sha>    a torch.save file closed (sha256)   C <path> <step>  the commit returned
  T <seconds>       the save call took this long        X/Y <path> a deletion begins/returned
  LOAD <path> ok|<error>                                ERR <msg>  the command failed
  DONE              the command finished

torch is imported only where a rank (or a check of the loop) needs it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import sys
import time
from collections.abc import Generator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from torch.distributed.checkpoint.filesystem import FileSystem
    from torch.distributed.device_mesh import DeviceMesh

KEEP = 2                  # rotation keeps the newest KEEP checkpoints of each kind

# a command from the loop: {"op": ..., "step": ..., "pause_rank": ..., "path": ..., "kind": ...}
Command = dict[str, Any]
# a training state: tensors by name (nested for torch.save), and the step
State = dict[str, Any]


def short_exc(e: BaseException) -> str:
    """One line for an exception (DCP's CheckpointException carries every rank's traceback:
    keep its last error line)."""
    text = str(e)
    errs = re.findall(r"\b\w+(?:Error|Exception): [^\n]*", text)
    msg = errs[-1] if errs else text.replace("\n", " ")
    return f"{e.__class__.__name__}: {msg}"[:500]


def make_state(seed: int, step: int, kind: str) -> State:
    """The deterministic training state saved at `step`: plain tensors (the reference)."""
    import torch

    g = torch.Generator().manual_seed(seed * 100003 + step)
    if kind == "pt":
        return {"model": {"w": torch.randn(256, 1024, generator=g),
                          "b": torch.randn(1024, generator=g)},
                "optim": {"m": torch.randn(128, 512, generator=g).to(torch.bfloat16)},
                "step": step}
    if kind == "dcp1":
        return {"w": torch.randn(512, 300, generator=g),
                "emb": torch.randint(-2**40, 2**40, (300, 64), generator=g),
                "step": torch.tensor(step)}
    assert kind == "dcp2"
    return {"sharded_w": torch.randn(512, 257, generator=g),
            "sharded_i": torch.randint(-2**40, 2**40, (256, 33), generator=g),
            "replicated": torch.randn(200, 100, generator=g).to(torch.float16),
            "step": torch.tensor(step)}


def _raise(e: OSError) -> None:
    raise e


class Hashing:
    """What torch.save writes to `path`, hashed on the way; pauses after the first write."""

    def __init__(self, rank: TrainerRank, f: IO[bytes], path: str, do_pause: bool) -> None:
        self.rank, self.f, self.path, self.do_pause = rank, f, path, do_pause
        self.h = hashlib.sha256()

    def write(self, b: bytes) -> int:
        n = self.f.write(b)
        self.h.update(b)
        if self.do_pause:
            self.do_pause = False
            self.f.flush()
            self.rank.pause(self.path)
        return n

    def flush(self) -> None:
        self.f.flush()


class PausingStream:
    """A DCP shard stream that pauses the rank after its first write."""

    def __init__(self, rank: TrainerRank, f: IO[bytes], path: str) -> None:
        self._rank, self._f, self._path, self._paused = rank, f, path, False

    def write(self, b: bytes) -> int:
        n = self._f.write(b)
        if not self._paused:
            self._paused = True
            self._f.flush()
            self._rank.pause(self._path)
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def pausing_fs(rank: TrainerRank, set_path: str) -> FileSystem:
    """A DCP FileSystem whose .distcp streams pause the rank after their first write."""
    from contextlib import contextmanager

    from torch.distributed.checkpoint.filesystem import FileSystem

    class PausingFS(FileSystem):
        @contextmanager
        def create_stream(self, path: str | os.PathLike[str], mode: str
                          ) -> Generator[io.IOBase, None, None]:
            with FileSystem.create_stream(self, path, mode) as s:
                if "w" in mode and str(path).endswith(".distcp"):
                    # a duck-typed wrapper: DCP only writes to (and closes) the stream
                    yield cast(io.IOBase, PausingStream(rank, cast(IO[bytes], s), set_path))
                else:
                    yield s
    return PausingFS()


class TrainerRank:
    """One rank: its mount, its seed, its process group (world > 1), and the commands."""

    def __init__(self, rank: int, world: int, init: str, mount: str, seed: int) -> None:
        import torch

        torch.set_num_threads(1)
        self.rank, self.world, self.mount, self.seed = rank, world, mount, seed
        self.root = Path(mount) / "ckpt"
        self.out = sys.stdout
        self.mesh: DeviceMesh | None = None
        if world > 1:
            from datetime import timedelta

            import torch.distributed as dist
            from torch.distributed.device_mesh import init_device_mesh
            dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank,
                                    world_size=world, timeout=timedelta(seconds=60))
            self.mesh = init_device_mesh("cpu", (world,))

    def ev(self, *a: object) -> None:
        self.out.write(" ".join(str(x) for x in a) + "\n")
        self.out.flush()

    def pause(self, path: str) -> None:
        self.ev("W", path)
        sys.stdin.readline()  # "go" (or EOF: the orchestrator is done with us)

    def save_torch(self, step: int, do_pause: bool) -> None:
        import torch

        root = self.root
        rel = f"ckpt/step_{step}.pt"
        self.ev("B", rel, step)
        t0 = time.monotonic()
        with open(root / f"step_{step}.pt.tmp", "wb") as f:
            w = Hashing(self, f, rel, do_pause)
            torch.save(make_state(self.seed, step, "pt"), cast(IO[bytes], w))
        self.ev("H", rel, w.h.hexdigest())
        os.rename(root / f"step_{step}.pt.tmp", root / f"step_{step}.pt")
        self.ev("T", f"{time.monotonic() - t0:.3f}")
        self.ev("C", rel, step)
        self.ev("B", "ckpt/latest", step)
        try:
            os.unlink(root / "latest.tmp")
        except FileNotFoundError:
            pass
        os.symlink(f"step_{step}.pt", root / "latest.tmp")
        os.rename(root / "latest.tmp", root / "latest")
        self.ev("C", "ckpt/latest", step)

    def save_dcp(self, step: int, kind: str, pause_rank: int | None) -> None:
        from torch.distributed.checkpoint.filesystem import FileSystemWriter
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        rel = f"ckpt/dcp_{step}"
        full = make_state(self.seed, step, kind)
        if kind == "dcp2":
            from torch.distributed.tensor import Shard, distribute_tensor
            sd = {k: distribute_tensor(v, self.mesh, [Shard(0)]) if k.startswith("sharded")
                  else v for k, v in full.items()}
        else:
            sd = full
        if self.rank == 0:
            self.ev("B", rel, step)
        writer = FileSystemWriter(str(self.root / f"dcp_{step}"))
        if pause_rank == self.rank:
            writer.fs = pausing_fs(self, rel)
        t0 = time.monotonic()
        dcp_save(sd, storage_writer=writer, no_dist=kind != "dcp2")
        if self.rank == 0:
            self.ev("T", f"{time.monotonic() - t0:.3f}")
            self.ev("C", rel, step)

    def rotation_victims(self) -> list[str]:
        """What a rotation deletes: all but the newest KEEP of each kind (never what latest
        names), and the leftovers of saves a fault interrupted."""
        root = self.root
        kinds: dict[str, list[tuple[int, str]]] = {"pt": [], "dcp": []}
        junk = []
        for name in sorted(os.listdir(root)):
            if name in ("latest", "latest.tmp"):
                continue
            m = re.fullmatch(r"(step_(\d+)\.pt)|(dcp_(\d+))", name)
            if m and m.group(1):
                kinds["pt"].append((int(m.group(2)), name))
            elif m and (root / name / ".metadata").exists():
                kinds["dcp"].append((int(m.group(4)), name))
            else:
                junk.append(name)  # leftovers of saves a fault interrupted
        try:
            protected: str | None = os.readlink(root / "latest")  # never delete what latest names
        except OSError:
            protected = None
        old = [n for v in kinds.values() for _, n in sorted(v)[:-KEEP] if n != protected]
        return old + junk

    def rotate(self, do_pause: bool) -> None:
        for name in self.rotation_victims():
            p = self.root / name
            self.ev("X", f"ckpt/{name}")
            if p.is_dir() and not p.is_symlink():
                # os.walk swallows a failed listing by default: a daemon killed mid-rotate
                # (ENOTCONN) then looked like a deletion that returned, with nothing deleted.
                for dirpath, _dirs, files in os.walk(p, topdown=False, onerror=_raise):
                    for n in sorted(files):
                        os.unlink(Path(dirpath) / n)
                        if do_pause:
                            do_pause = False
                            self.pause(f"ckpt/{name}")
                    os.rmdir(dirpath)
            else:
                p.unlink()
                if do_pause:
                    do_pause = False
                    self.pause(f"ckpt/{name}")
            self.ev("Y", f"ckpt/{name}")

    def load_dcp(self, path: str, step: int, kind: str) -> str:
        import torch
        from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

        full = make_state(self.seed, step, kind)
        target = {k: torch.zeros_like(v) for k, v in full.items()}
        dcp_load(target, checkpoint_id=str(Path(self.mount) / path), no_dist=True)
        bad = [k for k, v in full.items() if not torch.equal(target[k], v)]
        return "ok" if not bad else f"tensors differ: {bad}"

    def do(self, cmd: Command) -> bool:
        """Run one command; False for "exit"."""
        from torch.distributed.checkpoint.api import CheckpointException

        op = cmd["op"]
        if op == "torch":
            self.save_torch(cmd["step"], cmd.get("pause_rank") == self.rank)
        elif op in ("dcp1", "dcp2"):
            self.save_dcp(cmd["step"], op, cmd.get("pause_rank"))
        elif op == "rotate":
            self.rotate(cmd.get("pause_rank") == self.rank)
        elif op == "load_dcp":
            try:
                r = self.load_dcp(cmd["path"], cmd["step"], cmd["kind"])
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - judged outside
                r = short_exc(e)
            self.ev("LOAD", cmd["path"], r)
        elif op == "exit":
            return False
        return True

    def serve(self) -> None:
        import torch.distributed as dist
        from torch.distributed.checkpoint.api import CheckpointException

        self.root.mkdir(exist_ok=True)
        self.ev("READY")
        for line in sys.stdin:
            if not line.strip() or line.strip() == "go":
                continue
            cmd = json.loads(line)
            try:
                if not self.do(cmd):
                    break
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - a fault made it fail
                self.ev("ERR", f"{cmd['op']}: {short_exc(e)}")
            self.ev("DONE")
        if self.world > 1:
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001, S110 - the trainer is exiting; nothing to tell
                pass


def trainer_main(rank: int, world: int, init: str, mount: str, seed: int) -> None:
    TrainerRank(rank, world, init, mount, seed).serve()
