"""Training frameworks' own checkpointing, unmodified, through real mounts on one moto S3 store
(docs/INTEGRATIONS.md is the user's side of each recipe):

  * PyTorch Lightning `ModelCheckpoint` (top-k rotation, `save_last="link"`), resumed with
    `ckpt_path=` on a fresh node: same mount path, empty cache; and with the temporary
    directory on the mount, where its save's move into place is a rename.
  * Hugging Face Accelerate `save_state`/`load_state` with automatic checkpoint naming and
    `total_limit` rotation: model, optimizer and RNG states back bit-exact on a fresh node.
  * transformers `Trainer` on a tiny GPT-2 built from a config (no hub: HF_HUB_OFFLINE=1),
    `save_steps`, `save_total_limit=2`, `resume_from_checkpoint` on a fresh node.
  * torch's distributed state dict API (`get_state_dict`/`set_state_dict`, FSDP2 shards) with
    `dcp.save`/`dcp.load` on 2 gloo ranks, each on its own node; loaded on 2 fresh nodes.

Each test trains a few steps of a tiny model on the CPU, checks what the mount shows (the
checkpoints the framework kept, the ones it rotated away gone), that the store caught up (the
kept ones published as sets, the rotated ones deleted), and that a fresh node restores every
tensor bit-exact. Every test checks at the end that no daemon logged an unexpected error.
"""

from __future__ import annotations

import os
import random
import time
from datetime import timedelta
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from ckpt_restore import manifests
from torch import nn

import ckptfs
from tests import frameworks_helpers
from tests.conftest import run_processes, wait_for
from tests.frameworks_helpers import assert_same, sets_of, wait_published

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

# nodes(name, mountpoint=None): a started node on one bucket; nodes.view reads that bucket
nodes = frameworks_helpers.nodes


def snapshot(obj) -> dict:
    """A deep copy of a module's or optimizer's state dict (tensors cloned)."""
    import copy

    return copy.deepcopy(obj.state_dict())


# ----------------------------------------------------------------------------------------------
# PyTorch Lightning


def _lightning_module():
    import lightning.pytorch as pl

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            # what ModelCheckpoint ranks by (mode="max"): the newest checkpoints are the best
            self.log("seen", float(self.global_step), on_step=True, on_epoch=False)
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    return Tiny


def _lightning_trainer(dirpath: Path, max_steps: int, *callbacks):
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    ckpt = ModelCheckpoint(dirpath=dirpath, filename="{step}", every_n_train_steps=2,
                           save_top_k=2, monitor="seen", mode="max", save_last="link")
    return pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, callbacks=[ckpt, *callbacks])


def _lightning_data():
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(1)
    ds = TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g))
    return DataLoader(ds, batch_size=4)


def test_lightning_modelcheckpoint_rotation_and_resume_on_a_fresh_node(nodes):
    import lightning.pytorch as pl

    Tiny = _lightning_module()
    a = nodes("a")
    dirpath = a.path / "lightning"
    torch.manual_seed(0)
    model = Tiny()
    trainer = _lightning_trainer(dirpath, 6)
    trainer.fit(model, _lightning_data())
    # saves at steps 2, 4, 6; top-2 rotation removed step=2; last.ckpt links the newest
    assert sorted(os.listdir(dirpath)) == ["last.ckpt", "step=4.ckpt", "step=6.ckpt"]
    assert os.readlink(dirpath / "last.ckpt") == "step=6.ckpt"
    saved_model, saved_opt = snapshot(model), snapshot(trainer.optimizers[0])
    # each checkpoint is a file set of its own (written in place: fsspec moves it from a
    # temporary file in /tmp), last.ckpt a symlink set
    ckptfs.wait_durable(dirpath, timeout=120)
    states = sets_of(a, "lightning/")
    assert {p for p, s in states.items() if s == "durable"} == {
        "lightning/step=4.ckpt", "lightning/step=6.ckpt", "lightning/last.ckpt"}, states
    wait_published(nodes.view, "lightning", {"step=4.ckpt", "step=6.ckpt", "last.ckpt"})

    # A fresh node at the same path (Lightning keeps its rotation state only when the dirpath
    # is the same): the first node goes away, the second mounts its path with an empty cache.
    mountpoint = a.mountpoint
    a.stop()
    nodes("b", mountpoint=mountpoint)
    wait_for(lambda: (dirpath / "last.ckpt").exists(), timeout=30,
             what="the fresh node to list the published checkpoints")

    restored: dict = {}

    class Capture(pl.Callback):
        def on_train_start(self, trainer, module) -> None:
            restored.update(step=trainer.global_step, model=snapshot(module),
                            opt=snapshot(trainer.optimizers[0]))

    torch.manual_seed(99)  # another initialisation: everything must come from the checkpoint
    model_b = Tiny()
    trainer_b = _lightning_trainer(dirpath, 8, Capture())
    trainer_b.fit(model_b, _lightning_data(), ckpt_path=str(dirpath / "last.ckpt"))
    assert restored["step"] == 6
    assert_same(saved_model, restored["model"], "model")
    assert_same(saved_opt, restored["opt"], "optimizer")
    assert trainer_b.global_step == 8
    # the resumed run saved step 8 and rotated step 4 away, on the mount and in the store
    assert sorted(os.listdir(dirpath)) == ["last.ckpt", "step=6.ckpt", "step=8.ckpt"]
    assert os.readlink(dirpath / "last.ckpt") == "step=8.ckpt"
    ckptfs.wait_durable(dirpath, timeout=120)
    wait_published(nodes.view, "lightning", {"step=6.ckpt", "step=8.ckpt", "last.ckpt"})
    loaded = torch.load(dirpath / "last.ckpt", map_location="cpu", weights_only=False)
    assert loaded["global_step"] == 8
    assert_same(snapshot(model_b), loaded["state_dict"], "step 8")


def test_lightning_with_tmpdir_on_the_mount_commits_each_checkpoint_by_a_rename(nodes,
                                                                                monkeypatch):
    """Lightning's "atomic" save (fsspec's transaction) writes a temporary file in the
    process's temporary directory and moves it into place. With /tmp elsewhere that move is a
    copy into the final name (a killed copy leaves a torn file there, as on a local disk);
    with the temporary directory on the mount it is a rename, which commits the whole file at
    its final name and nothing before (docs/INTEGRATIONS.md)."""
    import tempfile

    Tiny = _lightning_module()
    a = nodes("a")
    (a.path / "tmp").mkdir()  # a temporary-looking name: nothing under it is committed
    monkeypatch.setattr(tempfile, "tempdir", str(a.path / "tmp"))
    dirpath = a.path / "lightning"
    torch.manual_seed(0)
    model = Tiny()
    _lightning_trainer(dirpath, 4).fit(model, _lightning_data())
    assert sorted(os.listdir(dirpath)) == ["last.ckpt", "step=2.ckpt", "step=4.ckpt"]
    assert os.listdir(a.path / "tmp") == []  # moved away: the move was a rename
    ckptfs.wait_durable(dirpath, timeout=120)
    # no set was ever committed under tmp/: each checkpoint's only set is its final name
    assert sets_of(a, "tmp/") == {}
    assert sets_of(a, "lightning/") == dict.fromkeys(
        ["lightning/step=2.ckpt", "lightning/step=4.ckpt", "lightning/last.ckpt"], "durable")
    loaded = torch.load(dirpath / "last.ckpt", map_location="cpu", weights_only=False)
    assert loaded["global_step"] == 4
    assert_same(snapshot(model), loaded["state_dict"], "step 4")


# ----------------------------------------------------------------------------------------------
# Hugging Face Accelerate


def _accelerator(project_dir: Path):
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    cfg = ProjectConfiguration(project_dir=str(project_dir), automatic_checkpoint_naming=True,
                               total_limit=2)
    return Accelerator(cpu=True, project_config=cfg)


def _accelerate_parts(acc, seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return acc.prepare(model, opt)


def _rng_states() -> dict:
    import numpy as np

    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
            "random": random.getstate()}


def test_accelerate_save_state_rotation_and_load_state_on_a_fresh_node(nodes):
    import numpy as np

    a = nodes("a")
    project = a.path / "accelerate"
    acc = _accelerator(project)
    model, opt = _accelerate_parts(acc, 0)
    for _ in range(3):  # three saves, a few steps apart: total_limit=2 keeps the last two
        for _ in range(2):
            loss = model(torch.randn(8, 16)).square().mean()
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
        rng = _rng_states()
        acc.save_state()
    ckpts = project / "checkpoints"
    assert sorted(os.listdir(ckpts)) == ["checkpoint_1", "checkpoint_2"]
    files = sorted(os.listdir(ckpts / "checkpoint_2"))
    assert {"model.safetensors", "optimizer.bin", "random_states_0.pkl"} <= set(files), files
    saved_model, saved_opt = snapshot(acc.unwrap_model(model)), snapshot(opt)
    # checkpoint_N/ is written in place, file by file: each file is a set of its own; a
    # directory wait covers them all
    reply = ckptfs.wait_durable(ckpts, timeout=120)
    assert reply["sets"] == 2 * len(files), reply
    wait_published(nodes.view, "accelerate/checkpoints",
                   {f"checkpoint_{n}/{f}" for n in (1, 2) for f in files})

    mountpoint = a.mountpoint
    a.stop()
    nodes("b", mountpoint=mountpoint)
    wait_for(lambda: (ckpts / "checkpoint_2" / "random_states_0.pkl").exists(), timeout=30,
             what="the fresh node to list the published checkpoints")
    acc_b = _accelerator(project)
    model_b, opt_b = _accelerate_parts(acc_b, 99)
    torch.manual_seed(12345)  # the RNGs elsewhere: load_state must put them back
    np.random.seed(12345)
    random.seed(12345)
    acc_b.load_state()  # automatic naming: the highest checkpoint_N
    assert_same(saved_model, snapshot(acc_b.unwrap_model(model_b)), "model")
    assert_same(saved_opt, snapshot(opt_b), "optimizer")
    assert_same(rng, _rng_states(), "rng")
    # load_state does not advance the naming: without this the next save_state would write
    # checkpoint_0, which load_state would never pick (docs/INTEGRATIONS.md)
    acc_b.project_configuration.iteration = 3
    acc_b.save_state()
    assert sorted(os.listdir(ckpts)) == ["checkpoint_2", "checkpoint_3"]
    ckptfs.wait_durable(ckpts, timeout=120)
    wait_published(nodes.view, "accelerate/checkpoints",
                   {f"checkpoint_{n}/{f}" for n in (2, 3) for f in files})


# ----------------------------------------------------------------------------------------------
# transformers Trainer


def _gpt2(seed: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


class _TokenIds(torch.utils.data.Dataset):
    """Random token ids, labels = inputs (causal LM): no tokenizer, nothing downloaded."""

    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(2)
        self.ids = torch.randint(0, 64, (n, 16), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _hf_trainer(model, output_dir: Path, max_steps: int, *callbacks):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(output_dir), max_steps=max_steps, save_steps=2,
                             save_total_limit=2, per_device_train_batch_size=4, use_cpu=True,
                             report_to=[], logging_strategy="no", seed=0,
                             dataloader_num_workers=0, disable_tqdm=True)
    return Trainer(model=model, args=args, train_dataset=_TokenIds(), callbacks=list(callbacks))


def test_hf_trainer_save_total_limit_and_resume_on_a_fresh_node(nodes, monkeypatch):
    from transformers import TrainerCallback

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    a = nodes("a")
    out = a.path / "hf"
    model = _gpt2(0)
    trainer = _hf_trainer(model, out, 6)
    trainer.train()
    # saves at 2, 4, 6; save_total_limit=2 removed checkpoint-2 (shutil.rmtree)
    assert sorted(os.listdir(out)) == ["checkpoint-4", "checkpoint-6"]
    files = sorted(os.listdir(out / "checkpoint-6"))
    assert {"model.safetensors", "trainer_state.json", "optimizer.pt", "scheduler.pt",
            "rng_state.pth"} <= set(files), files
    saved_model, saved_opt = snapshot(model), snapshot(trainer.optimizer)
    # transformers writes checkpoint-N/ in place, file by file (no temporary directory, no
    # rename): each file is committed as a set of its own at its last close
    ckptfs.wait_durable(out, timeout=120)
    states = sets_of(a, "hf/checkpoint-6/")
    assert states == {f"hf/checkpoint-6/{f}": "durable" for f in files}, states
    wait_published(nodes.view, "hf", {f"checkpoint-{n}/{f}" for n in (4, 6) for f in files})

    mountpoint = a.mountpoint
    a.stop()
    nodes("b", mountpoint=mountpoint)
    wait_for(lambda: (out / "checkpoint-6" / "trainer_state.json").exists(), timeout=30,
             what="the fresh node to list the published checkpoints")
    restored: dict = {}

    class Capture(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kw):
            restored.update(step=state.global_step, model=snapshot(model),
                            opt=snapshot(optimizer))

    model_b = _gpt2(99)
    trainer_b = _hf_trainer(model_b, out, 8, Capture())
    trainer_b.train(resume_from_checkpoint=True)  # the newest checkpoint-N in output_dir
    assert restored["step"] == 6
    assert_same(saved_model, restored["model"], "model")
    assert_same(saved_opt, restored["opt"], "optimizer")
    assert trainer_b.state.global_step == 8
    assert sorted(os.listdir(out)) == ["checkpoint-6", "checkpoint-8"]
    ckptfs.wait_durable(out, timeout=120)
    wait_published(nodes.view, "hf", {f"checkpoint-{n}/{f}" for n in (6, 8) for f in files})


# ----------------------------------------------------------------------------------------------
# torch.distributed.checkpoint.state_dict + DCP on 2 gloo ranks (FSDP2 shards)


def _fsdp_trained(mesh, seed: int, steps: int, rank: int):
    """A tiny FSDP2 model and its AdamW after `steps` deterministic steps (rank-local data)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * rank + step)
        model(torch.randn(8, 16, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _dcp_rank(rank: int, world: int, init: str, ckpts: list[str], mode: str) -> None:
    """One gloo rank: save (get_state_dict + dcp.save) or load (dcp.load + set_state_dict into
    a model initialised otherwise) the state through its own node's mount, and check it."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (world,))
    opts = StateDictOptions()  # sharded: each rank saves its own DTensor shards
    model, opt = _fsdp_trained(mesh, 0, 3, rank)
    msd, osd = get_state_dict(model, opt, options=opts)
    if mode == "save":
        dcp.save({"model": msd, "optim": osd, "step": 3}, checkpoint_id=ckpts[rank])
    else:
        fresh, fresh_opt = _fsdp_trained(mesh, 99, 0, rank)
        fmsd, fosd = get_state_dict(fresh, fresh_opt, options=opts)
        target = {"model": fmsd, "optim": fosd, "step": -1}
        dcp.load(target, checkpoint_id=ckpts[rank])
        set_state_dict(fresh, fresh_opt, model_state_dict=target["model"],
                       optim_state_dict=target["optim"], options=opts)
        assert target["step"] == 3
        got_m, got_o = get_state_dict(fresh, fresh_opt, options=opts)
        assert_same(msd, got_m, f"rank {rank} model")
        assert_same(osd, got_o, f"rank {rank} optimizer")
        # and the restored optimizer steps exactly as the original one
        for m, o in ((model, opt), (fresh, fresh_opt)):
            g = torch.Generator().manual_seed(7 + rank)
            m(torch.randn(8, 16, generator=g)).square().mean().backward()
            o.step()
        for (k, p), (_, q) in zip(model.named_parameters(), fresh.named_parameters()):
            assert torch.equal(p.to_local(), q.to_local()), (rank, k)
    dist.barrier()
    dist.destroy_process_group()


def _run_dcp_ranks(tmp: Path, ckpts: list[str], mode: str, timeout: float = 240) -> list:
    init = tmp / f"pg-{mode}-{time.monotonic_ns()}"
    return run_processes(_dcp_rank, [(r, len(ckpts), str(init), ckpts, mode)
                                     for r in range(len(ckpts))], timeout)


def test_distributed_state_dict_dcp_on_two_nodes_loads_on_two_fresh_nodes(nodes, tmp_path):
    a, b = nodes("a"), nodes("b")  # DCP's writer creates dcp/step_3 on each rank's node
    ckpts = [str(n.path / "dcp" / "step_3") for n in (a, b)]
    assert _run_dcp_ranks(tmp_path, ckpts, "save") == [0, 0]
    # rank 0 wrote its shard and .metadata through A, rank 1 its shard through B; the rename
    # of .metadata.tmp to .metadata on A committed the directory, with B's shard, as one set.
    # Once that set is durable, B's shard appears on A and the set on B (docs/SEMANTICS.md
    # "What the committing node sees"): on a fast store that can be before these listings
    # (seen on SeaweedFS), so each node shows what it wrote, or the whole set.
    whole = [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert sorted(os.listdir(ckpts[0])) in ([".metadata", "__0_0.distcp"], whole)
    assert sorted(os.listdir(ckpts[1])) in (["__1_0.distcp"], whole)
    assert ckptfs.wait_durable(ckpts[0], timeout=120)["path"] == "dcp/step_3"
    wait_published(nodes.view, "dcp", {"step_3"})
    m = manifests(nodes.view)["dcp/step_3"]
    assert sorted(f["path"] for f in m["files"]) == [".metadata", "__0_0.distcp",
                                                     "__1_0.distcp"]

    # two fresh nodes at the same paths, empty caches: every rank reads the whole set back
    points = [a.mountpoint, b.mountpoint]
    a.stop()
    b.stop()
    fresh = [nodes(f"fresh{i}", mountpoint=p) for i, p in enumerate(points)]
    for n in fresh:
        wait_for(lambda n=n: (n.path / "dcp" / "step_3" / ".metadata").exists(), timeout=30,
                 what="a fresh node to list the published set")
    assert sorted(os.listdir(ckpts[1])) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert _run_dcp_ranks(tmp_path, ckpts, "load") == [0, 0]
