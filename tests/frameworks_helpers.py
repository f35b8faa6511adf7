"""The helpers of the training frameworks' tests (tests/multinode/test_frameworks.py,
test_frameworks_megatron_ds.py): `nodes`, the fixture of started nodes on one moto S3 bucket;
what the store publishes; a framework's state dicts compared bit-exact (`assert_same`, run in the
ranks too).
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from ckpt_restore import S3StoreView, manifests

import ckptfs
from tests.conftest import wait_for

# A fresh node sees another node's sets once it lists the store: every second here.
NODE_ARGS = ("--refresh-interval", "1")


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
