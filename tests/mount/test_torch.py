"""PyTorch workloads through a real mount: torch.save/torch.load (plain and mmap), the careful
tmp + os.replace + `latest` symlink pattern, overwrite with O_TRUNC, PyTorch DCP (single process,
re-save into the same directory, and 2 gloo ranks), and data surviving a remount.

Every comparison is bit-exact: same keys, same dtype, same shape, `torch.equal`, and the same raw
bytes (so -0.0 vs 0.0 or a NaN payload would be caught too). Where torch.save output is
deterministic, the file written through the mount is also compared byte for byte with the same
object saved to the plain disk.
"""

from __future__ import annotations

import hashlib
import os
import random
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from tests.conftest import assert_loaded, start_ranks
from tests.dcpranks import gloo_mesh, mixed_state, sharded

pytestmark = [
    # DCP in a single process says it runs without a process group, and a re-save says it
    # overwrites: both intended here.
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    pytest.mark.filterwarnings("ignore:Detected an existing checkpoint:UserWarning"),
]


# ----------------------------------------------------------------------------------------------
# helpers


def assert_same(a, b, path: str = "sd") -> None:
    """Recursive bit-exact equality of checkpoint objects."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: {type(b)} is not a tensor"
        assert a.dtype == b.dtype, f"{path}: dtype {b.dtype} != {a.dtype}"
        assert a.shape == b.shape, f"{path}: shape {tuple(b.shape)} != {tuple(a.shape)}"
        assert torch.equal(a, b), f"{path}: values differ"
        if a.numel():
            ab = a.detach().contiguous().reshape(-1).view(torch.uint8)
            bb = b.detach().contiguous().reshape(-1).view(torch.uint8)
            assert torch.equal(ab, bb), f"{path}: raw bytes differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict), f"{path}: {type(b)} is not a dict"
        assert set(a) == set(b), f"{path}: keys {sorted(map(str, b))} != {sorted(map(str, a))}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b), f"{path}: {type(b)} is not {type(a)}"
        assert len(a) == len(b), f"{path}: length {len(b)} != {len(a)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif type(a).__module__ == "numpy":
        import numpy as np

        assert np.array_equal(a, b), f"{path}: numpy values differ"
    else:
        assert a == b, f"{path}: {b!r} != {a!r}"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def tensors(seed: int) -> dict[str, torch.Tensor]:
    """A few MB of tensors in several dtypes, including awkward shapes."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(512, 1024, generator=g)  # 2 MiB fp32
    return {
        "fp32": base,
        "fp32_t": torch.randn(300, 257, generator=g).t(),  # non-contiguous, odd sizes
        "bf16": torch.randn(1024, 768, generator=g).to(torch.bfloat16),
        "fp16": torch.randn(777, 1001, generator=g).to(torch.float16),
        "int64": torch.randint(-(2**62), 2**62, (131_071,), generator=g, dtype=torch.int64),
        "uint8": torch.randint(0, 256, (4097,), generator=g, dtype=torch.uint8),
        "bool": torch.rand(1000, generator=g) > 0.5,
        "scalar": torch.tensor(float(seed) + 0.5, dtype=torch.float64),
        "empty": torch.empty(0, 16),
        "neg_zero": torch.tensor([-0.0, 0.0, float("inf"), -float("inf")]),
    }


def trained_model(seed: int, steps: int = 3) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small MLP and its Adam state after `steps` deterministic steps."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                          nn.Linear(256, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        x = torch.randn(32, 256, generator=g)
        y = torch.randint(0, 10, (32,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model, opt


def full_state(seed: int) -> dict:
    """What a trainer saves: weights, optimizer state, RNG state, counters, extra tensors."""
    import numpy as np

    model, opt = trained_model(seed)
    random.seed(seed)
    np.random.seed(seed)
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                "numpy": np.random.get_state()},
        "step": 3 + seed,
        "tensors": tensors(seed),
    }


def dcp_state(seed: int) -> dict:
    """A state dict for DCP: nested tensors of several dtypes plus non-tensor values."""
    model, opt = trained_model(seed)
    return {"model": model.state_dict(), "optim": opt.state_dict(), "extra": tensors(seed),
            "step": seed}


def blank_like(sd):
    """The same structure with every tensor overwritten (DCP loads in place)."""
    if isinstance(sd, torch.Tensor):
        out = torch.empty_like(sd)
        if out.is_floating_point():
            out.fill_(7.25)
        elif out.dtype == torch.bool:
            out.fill_(True)
        else:
            out.fill_(7)
        return out
    if isinstance(sd, dict):
        return {k: blank_like(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [blank_like(v) for v in sd]
    return sd


def dcp_files(d: Path) -> set[str]:
    return {p.name for p in d.iterdir()}


# ----------------------------------------------------------------------------------------------
# torch.save / torch.load


def test_save_load_bit_exact(mnt, tmp_path):
    state = full_state(1)
    p = mnt.path / "ckpt.pt"
    torch.save(state, p)
    ref = tmp_path / "ckpt.pt"  # same name: torch.save puts the file's stem in the archive
    torch.save(state, ref)

    assert p.stat().st_size == ref.stat().st_size
    assert sha256(p) == sha256(ref), "torch.save wrote different bytes through the mount"
    loaded = torch.load(p, weights_only=False)
    assert_same(state, loaded)
    # Loading restores a usable trainer state: same RNG stream as the saved one.
    torch.set_rng_state(loaded["rng"]["torch"])
    a = torch.rand(8)
    torch.set_rng_state(state["rng"]["torch"])
    assert torch.equal(a, torch.rand(8))


def test_load_mmap_bit_exact(mnt):
    state = {"model": trained_model(2)[0].state_dict(), **tensors(2)}
    p = mnt.path / "weights.pt"
    torch.save(state, p)
    loaded = torch.load(p, mmap=True, weights_only=True)
    assert_same(state, loaded)
    del loaded
    # Twice, to read through a page cache the first mmap load may have filled.
    assert_same(state, torch.load(p, mmap=True, weights_only=True))


def test_tmp_replace_and_latest_symlink(mnt):
    """The careful pattern: save to a tmp name, os.replace it to the final name, point `latest`
    at it by replacing a symlink, rotate old checkpoints (keep 2)."""
    d = mnt.path / "run"
    d.mkdir()
    latest = d / "latest"
    saved: dict[int, dict] = {}
    held = None  # a checkpoint opened through `latest` before it is rotated away
    try:
        for step in (10, 20, 30, 40):
            state = {"step": step, **tensors(step)}
            saved[step] = state
            final = d / f"step_{step:04d}.pt"
            tmp = d / f".step_{step:04d}.pt.tmp"
            torch.save(state, tmp)
            os.replace(tmp, final)
            link_tmp = d / ".latest.tmp"
            os.symlink(final.name, link_tmp)
            os.replace(link_tmp, latest)
            # The Lightning-style `last.pt` overwritten by rename every time.
            torch.save(state, d / "last.pt.tmp")
            os.replace(d / "last.pt.tmp", d / "last.pt")

            assert os.readlink(latest) == final.name
            assert_same(state, torch.load(latest, weights_only=True))
            assert_same(state, torch.load(d / "last.pt", weights_only=True))
            if step == 20:
                held = open(latest, "rb")  # noqa: SIM115 -- kept open across rotation
            # Rotation: keep the newest two.
            for old in sorted(saved)[:-2]:
                (d / f"step_{old:04d}.pt").unlink(missing_ok=True)

        assert sorted(p.name for p in d.iterdir()) == [
            "last.pt", "latest", "step_0030.pt", "step_0040.pt"]
        assert os.readlink(latest) == "step_0040.pt"
        assert latest.resolve() == (d / "step_0040.pt").resolve()
        # step_0020.pt was unlinked while open: the open file still reads the old checkpoint.
        assert held is not None
        assert_same(saved[20], torch.load(held, weights_only=True))
    finally:
        if held is not None:
            held.close()

    mnt.remount()
    assert os.readlink(latest) == "step_0040.pt"
    assert_same(saved[40], torch.load(latest, weights_only=True))
    assert_same(saved[30], torch.load(d / "step_0030.pt", weights_only=True))
    assert_same(saved[40], torch.load(d / "last.pt", weights_only=True))


def test_overwrite_truncates(mnt, tmp_path):
    """torch.save onto an existing file opens it with O_TRUNC: shrinking and growing rewrites
    must leave exactly the new file."""
    p = mnt.path / "model.pt"
    big = full_state(3)
    small = {"w": torch.arange(10, dtype=torch.int64)}
    bigger = {"a": tensors(4), "b": tensors(5)}
    for i, state in enumerate((big, small, big, bigger)):
        torch.save(state, p)
        ref = tmp_path / f"ref{i}" / "model.pt"  # same name: the stem is in the archive
        ref.parent.mkdir()
        torch.save(state, ref)
        assert p.stat().st_size == ref.stat().st_size
        assert sha256(p) == sha256(ref)
        assert_same(state, torch.load(p, weights_only=False))
    # Reopened by another handle that reads while the file is rewritten smaller: it then sees
    # the new (short) file, never stale tail bytes.
    with open(p, "rb") as reader:
        torch.save(small, p)
        reader.seek(0)
        data = reader.read()
    assert data == (tmp_path / "ref1" / "model.pt").read_bytes()


# ----------------------------------------------------------------------------------------------
# DCP, single process


def test_dcp_save_load_bit_exact(mnt):
    sd = dcp_state(6)
    ckpt = mnt.path / "dcp" / "step_6"
    dcp.save(sd, checkpoint_id=ckpt)
    names = dcp_files(ckpt)
    assert ".metadata" in names
    assert ".metadata.tmp" not in names
    assert any(n.endswith(".distcp") for n in names), names

    target = blank_like(sd)
    dcp.load(target, checkpoint_id=ckpt)
    assert_same(sd, target)


def test_dcp_resave_same_dir(mnt):
    """A re-save into the same directory overwrites the shards in place and replaces
    .metadata; a load afterwards (and after a remount) must give only the new values."""
    ckpt = mnt.path / "dcp" / "latest"
    first = dcp_state(7)
    dcp.save(first, checkpoint_id=ckpt)
    target = blank_like(first)
    dcp.load(target, checkpoint_id=ckpt)
    assert_same(first, target)
    shards_before = {n: (ckpt / n).stat().st_ino for n in dcp_files(ckpt) if n.endswith(".distcp")}

    second = dcp_state(8)
    dcp.save(second, checkpoint_id=ckpt)
    names = dcp_files(ckpt)
    assert ".metadata" in names and ".metadata.tmp" not in names
    shards_after = {n: (ckpt / n).stat().st_ino for n in names if n.endswith(".distcp")}
    assert set(shards_after) == set(shards_before)  # same shard files, overwritten in place

    target = blank_like(second)
    dcp.load(target, checkpoint_id=ckpt)
    assert_same(second, target)

    mnt.remount()
    target = blank_like(second)
    dcp.load(target, checkpoint_id=ckpt)
    assert_same(second, target)


# ----------------------------------------------------------------------------------------------
# remount


def test_survives_remount(mnt):
    state = full_state(9)
    sd = dcp_state(10)
    torch.save(state, mnt.path / "a.pt")
    torch.save(state["model"], mnt.path / "b.pt")
    dcp.save(sd, checkpoint_id=mnt.path / "dcp")
    before = {p.relative_to(mnt.path): sha256(p) for p in mnt.path.rglob("*") if p.is_file()}
    assert len(before) >= 4

    mnt.remount()
    after = {p.relative_to(mnt.path): sha256(p) for p in mnt.path.rglob("*") if p.is_file()}
    assert after == before
    assert_same(state, torch.load(mnt.path / "a.pt", weights_only=False))
    assert_same(state["model"], torch.load(mnt.path / "b.pt", mmap=True, weights_only=True))
    target = blank_like(sd)
    dcp.load(target, checkpoint_id=mnt.path / "dcp")
    assert_same(sd, target)


# ----------------------------------------------------------------------------------------------
# DCP with 2 gloo ranks

WORLD = 2


def _dcp_rank(rank: int, store_path: str, ckpt: str, seed: int) -> None:
    """One rank: join a gloo group, DCP-save a state dict with Shard(0) DTensors and replicated
    plain tensors, then load it back distributed and check it."""
    with gloo_mesh(rank, WORLD, store_path) as mesh:
        full = mixed_state(seed, int64_rows=4096)
        sd = sharded(full, mesh)
        sd["rank_extra"] = {"step": seed}
        dcp.save(sd, checkpoint_id=ckpt)
        dist.barrier()

        target = sharded({k: torch.zeros_like(v) for k, v in full.items()}, mesh)
        target["rank_extra"] = {"step": -1}
        dcp.load(target, checkpoint_id=ckpt)
        assert_loaded(sd, target, rank)
        dist.barrier()


def test_dcp_two_gloo_ranks(mnt, tmp_path):
    ckpt = mnt.path / "dist" / "step_100"
    store = tmp_path / "filestore"  # outside the mount: only checkpoint data goes through it
    start_ranks(_dcp_rank, (str(store), str(ckpt), 100), WORLD)

    names = dcp_files(ckpt)
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= names, names
    assert ".metadata.tmp" not in names
    # Each rank wrote its own shard: both shard files hold data.
    assert all((ckpt / n).stat().st_size > 0 for n in ("__0_0.distcp", "__1_0.distcp"))

    # The metadata records the sharding: one chunk per rank for each Shard(0) tensor.
    expected = mixed_state(100, int64_rows=4096)  # what the ranks saved
    md = dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata
    for k in ("sharded_fp32", "sharded_bf16", "sharded_int64"):
        rows = expected[k].shape[0]
        assert sorted(c.offsets[0] for c in md[k].chunks) == [0, (rows + 1) // 2], k
    assert len(md["replicated_fp16"].chunks) == 1

    # Load the whole checkpoint in this single process (no process group) into full tensors.
    target = {k: blank_like(v) for k, v in expected.items()}
    target["rank_extra"] = {"step": -1}
    dcp.load(target, checkpoint_id=ckpt)
    for k, v in expected.items():
        assert_same(v, target[k], k)
    assert target["rank_extra"] == {"step": 100}

    # And again after a remount, from the cache on disk.
    mnt.remount()
    target = {k: blank_like(v) for k, v in expected.items()}
    dcp.load(target, checkpoint_id=ckpt)
    for k, v in expected.items():
        assert_same(v, target[k], k)

