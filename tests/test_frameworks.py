"""Training frameworks' own checkpointing, unmodified, through real mounts on one moto S3 store
(docs/INTEGRATIONS.md is the user's side of each recipe):

  * PyTorch Lightning `ModelCheckpoint` (top-k rotation, `save_last="link"`), resumed with
    `ckpt_path=` on a fresh node: same mount path, empty cache.
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
from ckpt_restore import S3StoreView, manifests
from conftest import rank_context, wait_for
from torch import nn

import ckptfs

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

# A fresh node sees another node's sets once it lists the store: every second here.
NODE_ARGS = ("--refresh-interval", "1")


# ----------------------------------------------------------------------------------------------
# helpers


@pytest.fixture
def nodes(mount_factory, s3_bucket):
    """nodes(name, mountpoint=None) -> a started node (its own, empty cache) on one bucket;
    nodes.view reads that bucket as ckpt_restore does."""
    endpoint, bucket = s3_bucket
    made = []

    def node(name: str, mountpoint: Path | None = None):
        m = mount_factory(name, mountpoint=mountpoint)
        m.start("--store", f"s3://{bucket}/p", "--s3-endpoint", endpoint, "--s3-path-style",
                *NODE_ARGS)
        made.append(m)
        return m

    node.view = S3StoreView(endpoint, bucket, "p")
    yield node
    for m in made:
        errors = m.unexpected_errors()
        assert not errors, f"daemon {m.mountpoint.name} logged unexpected errors:\n" + \
            "\n".join(errors)


def published(view, under: str) -> set[str]:
    """The set paths the store publishes under `under/` (relative to it)."""
    return {p.removeprefix(under + "/") for p in manifests(view) if p.startswith(under + "/")}


def wait_published(view, under: str, expect: set[str], timeout: float = 120) -> None:
    """Wait until the store publishes exactly `expect` under `under` (deletions included)."""
    wait_for(lambda: published(view, under) == expect, timeout=timeout,
             what=f"the store to publish exactly {sorted(expect)} under {under} "
                  f"(it has {sorted(published(view, under))})")


def sets_of(m, prefix: str) -> dict[str, str]:
    """This node's newest state of each set whose path starts with `prefix`."""
    rows = ckptfs.status(m.path)["tiering"]["sets"]
    return {s["path"]: s["state"] for s in rows if s["path"].startswith(prefix)}


def assert_same(a, b, where: str = "sd") -> None:
    """Recursive bit-exact equality: tensors by dtype, shape and raw bytes."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert (a.dtype, a.shape) == (b.dtype, b.shape), where
        if hasattr(a, "to_local"):
            a, b = a.to_local(), b.to_local()
        ab = a.detach().contiguous().reshape(-1).view(torch.uint8)
        bb = b.detach().contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(ab, bb), f"{where}: bytes differ"
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys {sorted(map(str, b))} != {sorted(map(str, a))}"
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif type(a).__module__ == "numpy":
        import numpy as np

        assert np.array_equal(a, b), where
    else:
        assert a == b, f"{where}: {b!r} != {a!r}"


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
