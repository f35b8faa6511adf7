"""Megatron-core `dist_checkpointing` and DeepSpeed `save_checkpoint`, each run for real on 2 gloo
CPU ranks through a real mount on one moto S3 store (docs/INTEGRATIONS.md is the user's side):

  * Megatron-core (torch_dist backend, as `megatron.training.checkpointing.save_checkpoint`
    drives it): `iter_0000003/` and `iter_0000006/` saved by `dist_checkpointing.save`, which
    writes `common.pt`, the DCP shards, `.metadata` (a rename: ckptfs commits the directory
    there) and then, after that commit, `metadata.json`; then `integrity.json` (megatron-core
    0.20's `verify_integrity`, written by this test as 0.20 does where the installed version
    predates it) and the tracker `latest_checkpointed_iteration.txt` rewritten in place at the
    root. `ckptfs wait` on the root, the node lost with its cache, and a fresh node loads
    iteration 6 with `dist_checkpointing.load`: model and optimizer shards bit-exact.
  * DeepSpeed ZeRO stage 2 and 3: `save_checkpoint` of two tags (`global_step2/`,
    `global_step4/`, each file a `torch.save` in place) with `latest` rewritten in place; a fresh
    node's `load_checkpoint` follows `latest` and gives every parameter and optimizer tensor back
    bit-exact, and the next step equals the original's.

Both frameworks make a few calls on a CPU-only torch that they would not make on their
supported hardware; each test says which and how it steps around them (`_megatron_on_cpu`,
`_deepspeed_on_cpu`). Every test checks at the end that no daemon logged an unexpected error.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import os
import shutil
import time
from datetime import timedelta
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from ckpt_restore import manifests
from torch import nn

from tests import frameworks_helpers
from tests.conftest import IN_CI, run_cli, run_processes, wait_for
from tests.frameworks_helpers import assert_same, sets_of, wait_published

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

# nodes(name, mountpoint=None): a started node on one bucket; nodes.view reads that bucket
nodes = frameworks_helpers.nodes

WORLD = 2


def _require(module: str) -> None:
    """Skip without `module` (the `test` extra installs it; in CI its absence fails). Looked up,
    not imported: the ranks import it, the test process has no use for it."""
    if importlib.util.find_spec(module) is None:
        why = f"{module} is not installed (pip install -e '.[test]')"
        if IN_CI:
            pytest.fail(why)
        pytest.skip(why)


def _run_ranks(fn, tmp: Path, *args, timeout: float = 120) -> list:
    """fn(rank, WORLD, init, *args) in WORLD processes; their exit codes."""
    init = tmp / f"pg-{time.monotonic_ns()}"
    return run_processes(fn, [(r, WORLD, str(init), *args) for r in range(WORLD)], timeout)


def _wait_cli(path: Path) -> str:
    """`ckptfs wait PATH` must exit 0; its output line."""
    res = run_cli("wait", str(path), "--timeout", "60")
    assert res.returncode == 0, \
        f"ckptfs wait {path}: exit {res.returncode}: {res.stderr.strip() or res.stdout.strip()}"
    return res.stdout.strip()


def _lose_node(node) -> Path:
    """The node goes away with its cache: unmounted, its cache directory deleted. Returns its
    mount point, for a fresh node at the same path."""
    node.stop()
    shutil.rmtree(node.cache_dir)
    return node.mountpoint


def _tensors(obj, where: str = "") -> dict:
    """Every tensor in a nested state dict, by its path, cloned."""
    out: dict = {}
    if isinstance(obj, torch.Tensor):
        out[where] = obj.detach().clone()
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_tensors(v, f"{where}/{k}"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(_tensors(v, f"{where}/{i}"))
    return out


# ----------------------------------------------------------------------------------------------
# Megatron-core dist_checkpointing (torch_dist), the layout megatron.training writes

MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"  # megatron.training.checkpointing
INTEGRITY = "integrity.json"  # megatron-core 0.20 dist_checkpointing.validation.INTEGRITY_FNAME


def _megatron_on_cpu() -> None:
    """megatron-core's torch_dist save makes two CUDA-only calls on every rank, which fail on a
    CPU build of torch ("Torch not compiled with CUDA enabled"); both are no-ops for CPU
    tensors, so they are made so here:
    `torch.cuda.synchronize()` after the device-to-host copies
    (strategies/filesystem_async.py `FileSystemWriterAsync.preload_tensors`), and the failure
    flag broadcast as a tensor on `torch.cuda.current_device()`
    (strategies/state_dict_saver.py `save_state_dict_async_finalize`). Nothing else of
    megatron-core is changed."""
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"


def _megatron_model(seed: int):
    """A tensor-parallel MLP of megatron-core layers (TP = 2: each rank holds half of fc1 by rows
    and half of fc2 by columns; fc2's bias is replicated) and its Adam."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import MegatronModule

    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                            use_cpu_initialization=True)

    class MLP(MegatronModule):
        def __init__(self) -> None:
            super().__init__(config=cfg)
            self.fc1 = ColumnParallelLinear(16, 64, config=cfg, init_method=nn.init.normal_,
                                            bias=True, gather_output=False)
            self.fc2 = RowParallelLinear(64, 16, config=cfg, init_method=nn.init.normal_,
                                         bias=True, input_is_parallel=True,
                                         skip_bias_add=False)

        def forward(self, x):
            h, _ = self.fc1(x)
            y, _ = self.fc2(torch.relu(h))
            return y

    torch.manual_seed(seed)
    model = MLP()
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _megatron_train(model, opt, start: int, stop: int) -> None:
    for it in range(start, stop):
        g = torch.Generator().manual_seed(it)  # the same batch on both TP ranks
        model(torch.randn(8, 16, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _megatron_state(model, opt, iteration: int, rank: int) -> dict:
    """The sharded state dict megatron.training's generate_state_dict builds: the model's own
    sharded_state_dict, the optimizer's as megatron.core.optimizer.FP32Optimizer
    .sharded_state_dict makes it (its constructor allocates on CUDA, so its two steps are done
    here: per-parameter states sharded like their parameters, one common step), a per-rank RNG
    state as a ShardedObject, and common values (common.pt)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    model_sd = model.sharded_state_dict(metadata=ensure_metadata_has_dp_cp_group(None))
    optim_sd = opt.state_dict()
    params = [p for g in opt.param_groups for p in g["params"]]
    step = next(iter(optim_sd["state"].values()))["step"]
    optim_state_to_sharding_state(optim_sd, get_param_id_to_sharded_param_map(model_sd, params),
                                  exclude_keys="step")
    optim_sd["state"]["common_step"] = step
    return {"model": model_sd, "optimizer": optim_sd, "iteration": iteration,
            "checkpoint_version": 3.0, "num_floating_point_operations_so_far": 0,
            "rng_state": ShardedObject("rng_state", [torch.get_rng_state()], (1, WORLD),
                                       (0, rank), replica_id=0)}


def _save_integrity_manifest(ckpt_dir: str) -> None:
    """megatron-core 0.20's `validation.save_integrity_manifest` (dist_checkpointing.save with
    verify_integrity=True, on rank 0 after metadata.json): the SHA-256 of every file of the
    directory, in integrity.json. Its own where installed, else the same steps."""
    try:
        from megatron.core.dist_checkpointing.validation import save_integrity_manifest
    except ImportError:
        files = {e.name: hashlib.sha256(e.read_bytes()).hexdigest()
                 for e in sorted(Path(ckpt_dir).iterdir(), key=str)
                 if e.is_file() and e.name != INTEGRITY}
        with open(os.path.join(ckpt_dir, INTEGRITY), "w") as f:
            json.dump({"algorithm": "sha256", "files": files}, f, indent=2)
    else:
        save_integrity_manifest(ckpt_dir)


def _verify_integrity_manifest(ckpt_dir: str) -> None:
    """megatron-core 0.20's `validation.verify_integrity_manifest` (load with
    verify_integrity=True): every file integrity.json lists hashes as listed."""
    manifest = json.loads(Path(ckpt_dir, INTEGRITY).read_text())
    assert manifest["algorithm"] == "sha256"
    listed = set(manifest["files"])
    assert listed == {e.name for e in Path(ckpt_dir).iterdir() if e.name != INTEGRITY}, listed
    for name, digest in manifest["files"].items():
        assert hashlib.sha256(Path(ckpt_dir, name).read_bytes()).hexdigest() == digest, name


def _megatron_rank(rank: int, world: int, init: str, root: str, ref: str, mode: str) -> None:
    """One gloo rank of a TP = 2 job. "save": train to iteration 3 and save, to 6 and save,
    each as megatron.training's save_checkpoint does for ckpt_format torch_dist (rank 0 makes
    iter_N/; dist_checkpointing.save; integrity.json; rank 0 rewrites the tracker in place),
    and keep what iteration 6 holds (and the step after it) in `ref` (local disk). "load": read
    the tracker, check the directory as megatron does and load it into a model initialised
    otherwise, then compare with `ref`."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    _megatron_on_cpu()
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.core import check_is_distributed_checkpoint

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    tracker = os.path.join(root, MEGATRON_TRACKER)
    mine = os.path.join(ref, f"megatron-rank{rank}.pt")
    if mode == "save":
        model, opt = _megatron_model(0)
        done = 0
        for iteration in (3, 6):
            _megatron_train(model, opt, done, iteration)
            done = iteration
            name = os.path.join(root, f"iter_{iteration:07d}")
            if rank == 0:
                os.makedirs(name, exist_ok=True)  # ensure_directory_exists(checkpoint_name)
            # common.pt (rank 0), every rank's __<rank>_<n>.distcp, .metadata.tmp renamed to
            # .metadata (rank 0), then metadata.json (rank 0) and a barrier
            dist_checkpointing.save(_megatron_state(model, opt, iteration, rank), name)
            if rank == 0:
                _save_integrity_manifest(name)
            dist.barrier()
            if rank == 0:  # save_checkpoint's iter_finalize_fn: the tracker, in place
                with open(tracker, "w") as f:
                    f.write(str(iteration))
            dist.barrier()
        saved = {"model": copy.deepcopy(model.state_dict()),
                 "optim": copy.deepcopy(opt.state_dict()), "rng": torch.get_rng_state()}
        _megatron_train(model, opt, 6, 7)
        saved["next"] = copy.deepcopy(model.state_dict())
        torch.save(saved, mine)
        if rank == 0:
            for f in ("metadata.json", INTEGRITY):
                shutil.copyfile(os.path.join(root, "iter_0000006", f), os.path.join(ref, f))
    else:
        saved = torch.load(mine, weights_only=False)
        with open(tracker) as f:  # megatron.training.checkpointing.read_metadata
            iteration = int(f.read().strip())
        assert iteration == 6, iteration
        name = os.path.join(root, f"iter_{iteration:07d}")
        # load_checkpoint's test: without metadata.json, "not a distributed checkpoint"
        assert check_is_distributed_checkpoint(name), f"{name}: no metadata.json"
        if rank == 0:
            _verify_integrity_manifest(name)
            for f in ("metadata.json", INTEGRITY):
                assert Path(name, f).read_bytes() == Path(ref, f).read_bytes(), f
        model, opt = _megatron_model(99)
        _megatron_train(model, opt, 100, 101)  # the optimizer's states exist (init_state_fn)
        loaded = dist_checkpointing.load(_megatron_state(model, opt, -1, rank), name)
        assert loaded["iteration"] == 6
        model.load_state_dict(loaded["model"])
        osd = loaded["optimizer"]  # FP32Optimizer.load_state_dict
        step = osd["state"].pop("common_step")
        for s in osd["state"].values():
            s["step"] = copy.deepcopy(step)
        opt.load_state_dict(osd)
        assert_same(saved["model"], model.state_dict(), f"rank {rank} model")
        assert_same(saved["optim"], opt.state_dict(), f"rank {rank} optimizer")
        assert torch.equal(saved["rng"], loaded["rng_state"][0]), f"rank {rank} rng_state"
        _megatron_train(model, opt, 6, 7)
        assert_same(saved["next"], model.state_dict(), f"rank {rank} model after a step")
    dist.barrier()
    dist.destroy_process_group()


def test_megatron_core_late_metadata_json_and_tracker_load_on_a_fresh_node(nodes, tmp_path):
    _require("megatron.core")
    a = nodes("a")
    root = a.path / "megatron"
    ref = tmp_path / "ref"
    ref.mkdir()
    assert _run_ranks(_megatron_rank, tmp_path, str(root), str(ref), "save") == [0, 0]
    ckpt = root / "iter_0000006"
    files = sorted(os.listdir(ckpt))
    assert {".metadata", "common.pt", "__0_0.distcp", "__1_0.distcp", "metadata.json",
            INTEGRITY} <= set(files), files
    assert sorted(os.listdir(root)) == ["iter_0000003", "iter_0000006", MEGATRON_TRACKER]
    assert (root / MEGATRON_TRACKER).read_text() == "6"
    # the .metadata rename committed each directory as a set; metadata.json and integrity.json
    # were written into it after that commit, the tracker rewritten after them: the wait on the
    # root must cover all of it (a file in no set would make it exit 8 and name the file)
    out = _wait_cli(root)
    assert "3 sets durable" in out, out
    kept = {"iter_0000003", "iter_0000006", MEGATRON_TRACKER}
    states = sets_of(a, "megatron/")  # common.pt's own file sets were absorbed by iter_N's
    assert all(states.get(f"megatron/{p}") == "durable" for p in kept), states
    wait_published(nodes.view, "megatron", kept)
    published = manifests(nodes.view)
    for it in ("iter_0000003", "iter_0000006"):
        listed = sorted(f["path"] for f in published[f"megatron/{it}"]["files"])
        assert listed == sorted(os.listdir(root / it)), (it, listed)
    assert {"metadata.json", INTEGRITY} <= {
        f["path"] for f in published["megatron/iter_0000006"]["files"]}

    # node A is lost with its cache; a fresh node (empty cache) on the same store
    nodes("b", mountpoint=_lose_node(a))
    wait_for(lambda: (ckpt / INTEGRITY).exists(), timeout=30,
             what="the fresh node to list the published checkpoints")
    assert (root / MEGATRON_TRACKER).read_text() == "6"
    assert sorted(os.listdir(ckpt)) == files
    assert _run_ranks(_megatron_rank, tmp_path, str(root), str(ref), "load") == [0, 0]


# ----------------------------------------------------------------------------------------------
# DeepSpeed ZeRO stage 2 and 3: save_checkpoint / load_checkpoint


def _deepspeed_on_cpu(rank: int, world: int) -> None:
    """DeepSpeed on a CPU-only torch: the CPU accelerator (DS_ACCELERATOR=cpu, gloo), the
    launcher's environment, and no shared-memory allreduce op: DeepSpeed would compile it at
    the first init_distributed (a C++ JIT build of about 3 minutes on 2 cores, cached in
    ~/.cache/torch_extensions); without it collectives go through gloo, as they do wherever
    the op cannot be built."""
    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def _ds_engine(stage: int, seed: int):
    import deepspeed

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
              "zero_optimization": {"stage": stage}, "steps_per_print": 10**6}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)
    return engine


def _ds_train(engine, rank: int, start: int, stop: int) -> None:
    for step in range(start, stop):
        g = torch.Generator().manual_seed(1000 * rank + step)
        engine.backward(engine(torch.randn(4, 16, generator=g)).square().mean())
        engine.step()


def _ds_state(engine) -> dict:
    """Every parameter whole (ZeRO-3 gathers its partitions) and every tensor of this rank's
    optimizer state (ZeRO's fp32 partitions and the AdamW states)."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        params = {k: p.detach().clone() for k, p in engine.module.named_parameters()}
    return {"params": params, "optim": _tensors(engine.optimizer.state_dict()),
            "steps": engine.global_steps}


def _deepspeed_rank(rank: int, world: int, init: str, root: str, ref: str, stage: int,
                    mode: str) -> None:
    """One data-parallel gloo rank. "save": 2 steps, save_checkpoint(tag global_step2), 2 more,
    save_checkpoint() (tag global_step4, the default name); `latest` rewritten by rank 0 each
    time; keep the state and the next step's parameters in `ref`. "load": load_checkpoint(root)
    into an engine initialised otherwise, compare, step once more and compare."""
    _deepspeed_on_cpu(rank, world)
    import deepspeed

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False,
                               init_method=f"file://{init}", rank=rank, world_size=world,
                               timeout=timedelta(seconds=60), verbose=False)
    mine = os.path.join(ref, f"ds-rank{rank}.pt")
    if mode == "save":
        engine = _ds_engine(stage, 0)
        _ds_train(engine, rank, 0, 2)
        engine.save_checkpoint(root, tag="global_step2")
        _ds_train(engine, rank, 2, 4)
        engine.save_checkpoint(root)
        saved = _ds_state(engine)
        _ds_train(engine, rank, 4, 5)
        saved["next"] = _ds_state(engine)["params"]
        torch.save(saved, mine)
    else:
        saved = torch.load(mine, weights_only=False)
        engine = _ds_engine(stage, 99)
        path, _ = engine.load_checkpoint(root)  # the tag `latest` names
        assert path is not None and "global_step4" in path, path
        got = _ds_state(engine)
        assert got["steps"] == saved["steps"] == 4
        assert_same(saved["params"], got["params"], f"rank {rank} parameters")
        assert_same(saved["optim"], got["optim"], f"rank {rank} optimizer")
        _ds_train(engine, rank, 4, 5)
        assert_same(saved["next"], _ds_state(engine)["params"], f"rank {rank} after a step")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_save_checkpoint_latest_and_load_on_a_fresh_node(nodes, tmp_path, stage):
    _require("deepspeed")
    a = nodes("a")
    root = a.path / "ds"
    ref = tmp_path / "ref"
    ref.mkdir()
    assert _run_ranks(_deepspeed_rank, tmp_path, str(root), str(ref), stage, "save") == [0, 0]
    # each tag's files written in place with torch.save (file sets of their own); `latest` and
    # the recovery scripts (zero_to_fp32.py, ...) rewritten in place at the root by each save
    files = sorted(os.listdir(root / "global_step4"))
    per_rank = "model_states" if stage == 3 else "optim_states"
    assert {f"zero_pp_rank_{r}_mp_rank_00_{per_rank}.pt" for r in range(WORLD)} <= set(files)
    assert sorted(os.listdir(root / "global_step2")) == files
    top = sorted(os.listdir(root))
    assert {"global_step2", "global_step4", "latest", "zero_to_fp32.py"} <= set(top), top
    assert (root / "latest").read_text() == "global_step4"
    _wait_cli(root)
    scripts = [f for f in top if f.endswith(".py")]
    wait_published(nodes.view, "ds", {f"global_step{n}/{f}" for n in (2, 4) for f in files}
                   | {"latest", *scripts})

    nodes("b", mountpoint=_lose_node(a))
    wait_for(lambda: all((root / "global_step4" / f).exists() for f in files), timeout=30,
             what="the fresh node to list the published checkpoints")
    assert (root / "latest").read_text() == "global_step4"
    assert _run_ranks(_deepspeed_rank, tmp_path, str(root), str(ref), stage, "load") == [0, 0]
