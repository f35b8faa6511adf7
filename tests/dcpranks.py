"""Gloo ranks of the DCP tests (tests/multinode/test_restore.py, test_restore_scale.py,
test_multinode.py, test_resume.py, tests/mount/test_torch.py): the process group a rank joins,
the state dicts the ranks save with Shard(0) DTensors, and the resuming job's load that checks
each rank's slices.

The ranks run in processes started by conftest.start_ranks (from the ranks' forkserver), which
unpickle what they run by name: the rank functions here are module-level, and so must be the
state function a test hands them (`state(seed)` -> the full, unsharded tensors by name; keys
starting with "sharded" are saved as Shard(0) DTensors, the others replicated).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

State = Callable[[int], dict[str, torch.Tensor]]


def mixed_state(seed: int, int64_rows: int = 4099) -> dict[str, torch.Tensor]:
    """Sharded fp32, bf16 and int64 tensors (`int64_rows` rows: 4099 does not split evenly)
    and replicated fp16 and int64 ones: the full tensors every rank agrees on."""
    g = torch.Generator().manual_seed(seed)
    return {
        "sharded_fp32": torch.randn(1024, 513, generator=g),
        "sharded_bf16": torch.randn(998, 300, generator=g).to(torch.bfloat16),
        "sharded_int64": torch.randint(-(2**40), 2**40, (int64_rows, 33), generator=g),
        "replicated_fp16": torch.randn(700, 321, generator=g).to(torch.float16),
        "replicated_int64": torch.arange(12345, dtype=torch.int64) * 3,
    }


@contextmanager
def gloo_mesh(rank: int, world: int, store_path: str,
              timeout: timedelta | None = None) -> Iterator:
    """This process as rank `rank` of a `world`-rank gloo group (rendezvous on the file
    `store_path`), on one CPU thread, for the block: yields the group's 1-D CPU device mesh;
    the group is destroyed after the block, whatever it raised. `timeout`: how long a
    collective waits for a rank that never comes (a killed one); None: torch's default."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    kw = {} if timeout is None else {"timeout": timeout}
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=world, **kw)
    try:
        yield init_device_mesh("cpu", (world,))
    finally:
        dist.destroy_process_group()


def sharded(state: dict, mesh) -> dict:
    """`state` with each "sharded*" tensor distributed over `mesh` as Shard(0) (this rank's
    rows, split like torch.chunk), every other value as it is (replicated)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    return {k: distribute_tensor(v, mesh, [Shard(0)]) if k.startswith("sharded") else v
            for k, v in state.items()}


def save_rank(rank: int, world: int, store_path: str, ckpt: str | list[str], state: State,
              seed: int, killed: bool = False, timeout: timedelta | None = None) -> None:
    """A rank of the saving job: DCP-saves `state(seed)` (Shard(0) DTensors plus replicated
    tensors) and {"step": seed} as "meta" to `ckpt` (a list: this rank's entry, each rank
    writing through its own node). `killed`: this rank SIGKILLs itself while its shard file is
    being written (a rank lost mid-save); the others then fail after `timeout`."""
    if isinstance(ckpt, list):
        ckpt = ckpt[rank]
    with gloo_mesh(rank, world, store_path, timeout) as mesh:
        sd = sharded(state(seed), mesh)
        sd["meta"] = {"step": seed}
        if killed:
            _kill_when_written(Path(ckpt) / f"__{rank}_0.distcp")
        dcp.save(sd, checkpoint_id=ckpt)
        dist.barrier()


def _kill_when_written(shard: Path) -> None:
    """SIGKILL this process as soon as `shard` holds a byte (a thread polling every 1 ms, so
    that the kill lands while the shard is being written, not after the save)."""
    def killer() -> None:
        while not (shard.exists() and shard.stat().st_size > 0):
            time.sleep(0.001)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=killer, daemon=True).start()


def load_rank(rank: int, world: int, store_path: str, ckpt: str | list[str], state: State,
              seed: int, whole: bool = False, timeout: timedelta | None = None) -> None:
    """A rank of the resuming job (any world size) loading what save_rank saved from `ckpt`
    (a list: this rank's entry, each rank reading through its own node): the sharded tensors
    as Shard(0) DTensors over `world` ranks, checked against this rank's rows of the saved
    tensor byte for byte, the replicated ones and "meta" whole. `whole`: then every tensor in
    full as well (as a job that reshards after loading), checked byte for byte."""
    if isinstance(ckpt, list):
        ckpt = ckpt[rank]
    with gloo_mesh(rank, world, store_path, timeout) as mesh:
        full = state(seed)
        target = sharded({k: torch.full_like(v, 7) for k, v in full.items()}, mesh)
        target["meta"] = {"step": -1}
        dcp.load(target, checkpoint_id=ckpt)
        for k, v in full.items():
            if k.startswith("sharded"):
                # Shard(0) splits like torch.chunk: this rank's rows of the saved tensor.
                parts = v.chunk(world)
                want = parts[rank] if rank < len(parts) else v[:0]
                got = target[k].to_local()
                assert got.dtype == want.dtype and got.shape == want.shape, (rank, k)
                assert torch.equal(got.contiguous().view(torch.uint8),
                                   want.contiguous().view(torch.uint8)), (rank, k)
            else:
                assert torch.equal(target[k], v), (rank, k)
        assert target["meta"] == {"step": seed}
        if whole:
            everything = {k: torch.full_like(v, 7) for k, v in full.items()}
            everything["meta"] = {"step": -1}
            dcp.load(everything, checkpoint_id=ckpt)
            for k, v in full.items():
                assert torch.equal(everything[k].view(torch.uint8), v.view(torch.uint8)), \
                    (rank, k)
            assert everything["meta"] == {"step": seed}
        dist.barrier()
