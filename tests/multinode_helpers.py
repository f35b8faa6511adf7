"""The multi-node cluster of tests/multinode/test_multinode.py and test_resume.py: `cluster`, the
fixture of nodes started on one moto S3 bucket, their status, and DCP gloo ranks that each save or
load through their own node's mount (`run_ranks`; `_rank` runs in the ranks' forkserver).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ckpt_restore import S3StoreView

import ckptfs
from tests.conftest import assert_loaded, run_processes, start_with_env


@pytest.fixture
def cluster(mount_factory, s3_bucket, tmp_path):
    """cluster(name, env=None, *extra) -> a started node on the shared bucket."""
    endpoint, bucket = s3_bucket
    made = []

    def node(name: str, *extra: str, env: dict | None = None, start: bool = True):
        m = mount_factory(name)
        m.args = ["--store", f"s3://{bucket}/p", "--s3-endpoint", endpoint, "--s3-path-style",
                  "--refresh-interval", "1", "--part-size", "5M", *extra]
        made.append(m)
        if start:
            start_node(m, env)
        return m

    node.view = S3StoreView(endpoint, bucket, "p")
    node.tmp = tmp_path
    yield node
    for m in made:
        errors = m.unexpected_errors()
        assert not errors, f"daemon {m.mountpoint.name} logged unexpected errors:\n" + \
            "\n".join(errors)


def start_node(m, env: dict | None = None) -> None:
    """Start node `m` with its own arguments (`m.args`), `env` in its daemon's environment."""
    start_with_env(m, env or {}, *m.args)


def status(m) -> dict:
    return ckptfs.status(m.path)["tiering"]


def set_row(m, path: str) -> dict | None:
    rows = [s for s in status(m)["sets"] if s["path"] == path]
    return rows[-1] if rows else None


def node_id(m) -> str:
    return status(m)["store"]["node"]


def _global(seed: int, big: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = 4096 if big else 1024
    return {
        "sharded_fp32": torch.randn(n, 1027, generator=g),
        "sharded_bf16": torch.randn(998, 300, generator=g).to(torch.bfloat16),
        "sharded_int64": torch.randint(-(2**40), 2**40, (4096, 33), generator=g),
        "replicated_fp16": torch.randn(700, 321, generator=g).to(torch.float16),
        "replicated_int64": torch.arange(12345, dtype=torch.int64) * 3,
    }


def _rank(rank: int, world: int, init: str, ckpts: list[str], seed: int, mode: str,
          kill_rank: int, big: bool) -> None:
    """One gloo rank: DCP-save (mode "save") or DCP-load-and-check (mode "load") a state dict
    of Shard(0) DTensors and replicated tensors through its own node's mount."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    mesh = init_device_mesh("cpu", (world,))
    full = _global(seed, big)
    sd = {k: distribute_tensor(v, mesh, [Shard(0)]) if k.startswith("sharded") else v
          for k, v in full.items()}
    sd["extra"] = {"seed": seed}
    if mode == "save":
        if rank == kill_rank:
            mine = Path(ckpts[rank]) / f"__{rank}_0.distcp"

            def killer():
                while not (mine.exists() and mine.stat().st_size > 0):
                    # A poll of the condition, every 1 ms so that the kill lands while the
                    # shard is being written (wait_for backs off to 100 ms: the save could end).
                    time.sleep(0.001)
                os.kill(os.getpid(), signal.SIGKILL)  # mid-save: its shard is being written

            threading.Thread(target=killer, daemon=True).start()
        dcp.save(sd, checkpoint_id=ckpts[rank])
    else:
        target = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)])
                  if k.startswith("sharded") else torch.zeros_like(v)
                  for k, v in full.items()}
        target["extra"] = {"seed": -1}
        dcp.load(target, checkpoint_id=ckpts[rank])
        assert_loaded(sd, target, rank)
    dist.barrier()
    dist.destroy_process_group()


def run_ranks(tmp: Path, ckpts: list[str], seed: int, mode: str = "save", kill_rank: int = -1,
              big: bool = False, timeout: float = 240) -> list[int]:
    """Run len(ckpts) gloo ranks (rank r uses ckpts[r]); returns their exit codes."""
    init = tmp / f"pg-{mode}-{seed}-{time.monotonic_ns()}"
    return run_processes(_rank, [(r, len(ckpts), str(init), ckpts, seed, mode, kill_rank, big)
                                 for r in range(len(ckpts))], timeout)
