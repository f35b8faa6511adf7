"""The multi-node cluster of tests/multinode/test_multinode.py and test_resume.py: `cluster`, the
fixture of nodes started on one moto S3 bucket, their status, and DCP gloo ranks that each save or
load through their own node's mount (`run_ranks`: tests/dcpranks.py's ranks).
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from ckpt_restore import S3StoreView

import ckptfs
from tests.conftest import run_processes, start_with_env
from tests.dcpranks import load_rank, save_rank


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


def multinode_state(seed: int, big: bool = False) -> dict[str, torch.Tensor]:
    """The full tensors the multi-node DCP jobs save (tests/dcpranks.py `State`): sharded
    fp32 (4,096 rows if `big`: a save long enough to kill a rank in), bf16 and int64, and
    replicated fp16 and int64."""
    g = torch.Generator().manual_seed(seed)
    n = 4096 if big else 1024
    return {
        "sharded_fp32": torch.randn(n, 1027, generator=g),
        "sharded_bf16": torch.randn(998, 300, generator=g).to(torch.bfloat16),
        "sharded_int64": torch.randint(-(2**40), 2**40, (4096, 33), generator=g),
        "replicated_fp16": torch.randn(700, 321, generator=g).to(torch.float16),
        "replicated_int64": torch.arange(12345, dtype=torch.int64) * 3,
    }


def big_state(seed: int) -> dict[str, torch.Tensor]:
    return multinode_state(seed, big=True)


# a collective waits this long for a rank that never comes (a killed one) before it fails
RANK_TIMEOUT = timedelta(seconds=30)


def run_ranks(tmp: Path, ckpts: list[str], seed: int, mode: str = "save", kill_rank: int = -1,
              big: bool = False, timeout: float = 240) -> list[int]:
    """Run len(ckpts) gloo ranks (rank r uses ckpts[r], through its own node's mount):
    dcpranks.save_rank (mode "save"; `kill_rank` SIGKILLed mid-save) or load_rank (mode
    "load": each rank's slices checked byte for byte); returns their exit codes."""
    init = str(tmp / f"pg-{mode}-{seed}-{time.monotonic_ns()}")
    state = big_state if big else multinode_state
    world = len(ckpts)
    if mode == "save":
        return run_processes(save_rank, [(r, world, init, ckpts, state, seed, r == kill_rank,
                                          RANK_TIMEOUT) for r in range(world)], timeout)
    return run_processes(load_rank, [(r, world, init, ckpts, state, seed, False, RANK_TIMEOUT)
                                     for r in range(world)], timeout)
