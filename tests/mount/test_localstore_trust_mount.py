"""The file:// store trusts nothing it reads from its directory (cachemgr/store/local.py), through
real mounts (LocalStore itself: tests/stores/test_localstore_trust.py): a daemon keeps serving
(and a fresh mount starts) over malformed sidecars, and its GC deletes nothing outside the store
through a planted symlink.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ckpt_restore import FileStoreView, manifests

import ckptfs
from tests.conftest import wait_for
from tests.localstore_helpers import sidecar

# ----------------------------------------------------------------------------------------------
# through real mounts


def _plant_sidecars(store_dir: Path, content: bytes) -> list[str]:
    keys = FileStoreView(store_dir).keys("")
    for key in keys:
        p = sidecar(store_dir, key)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content)
    return keys


def test_mount_serves_and_new_mount_starts_over_malformed_sidecars(mount_factory):
    """Every sidecar in the store (the published set's data object and manifest included)
    holds `[]`: the running daemon keeps listing and serving, and a fresh mount on the store
    starts and reads the file back from the store, bit-exact."""
    a = mount_factory("a")
    a.start("--refresh-interval", "0.2")
    data = os.urandom(600_000)
    (a.path / "model.bin").write_bytes(data)
    ckptfs.wait_durable(a.path / "model.bin", timeout=60)
    man = manifests(FileStoreView(a.store_dir))["model.bin"]
    data_key = man["files"][0]["object"]["key"]
    keys = _plant_sidecars(a.store_dir, b"[]")
    assert data_key in keys and "manifests/model.bin.json" in keys

    # Gate: two full listings of the store's manifests after the planting.
    syncs = ckptfs.status(a.path)["tiering"]["remote"]["syncs"]
    wait_for(lambda: ckptfs.status(a.path)["tiering"]["remote"]["syncs"] >= syncs + 2,
             timeout=60, what="two listings after the planting")
    assert (a.path / "model.bin").read_bytes() == data

    b = mount_factory("b")
    b.start("--store", f"file://{a.store_dir}")
    assert (b.path / "model.bin").read_bytes() == data
    st = ckptfs.status(b.path)["tiering"]
    assert st["remote"]["restored_sets"] >= 1
    for m in (a, b):
        assert not m.unexpected_errors(), m.unexpected_errors()


def test_gc_through_planted_symlink_deletes_nothing_outside(mount_factory, tmp_path):
    """The object directories of a published set are swapped for symlinks to a directory
    outside the store holding the same files. Deleting the set through the mount (rm -rf) makes
    the daemon delete its manifest, then its objects (GC): it refuses to go through the
    symlinks, and every file outside is still there."""
    m = mount_factory("g")
    m.start()
    tmp = m.path / "ck.tmp"
    tmp.mkdir()
    files = {f"rank{r}.pt": os.urandom(200_000 + r) for r in range(2)}
    for name, data in files.items():
        (tmp / name).write_bytes(data)
    os.rename(tmp, m.path / "ck")
    ckptfs.wait_durable(m.path / "ck", timeout=60)
    view = FileStoreView(m.store_dir)
    keys = [f["object"]["key"] for f in manifests(view)["ck"]["files"]]
    assert len(keys) == 2

    outside = tmp_path / "outside"
    outside.mkdir()
    victims = {}
    for key in keys:
        # data/<node>/<ino>/<version>/<name>: objects/data/<node>/<ino> becomes a symlink to
        # outside/<ino>, which holds <version>/<name> (the object itself, moved out).
        node_dir = m.store_dir / "objects" / "/".join(key.split("/")[:2])
        ino = key.split("/")[2]
        shutil.move(node_dir / ino, outside / ino)
        (node_dir / ino).symlink_to(outside / ino)
        victim = outside / "/".join(key.split("/")[2:])
        victims[victim] = victim.read_bytes()
    assert set(victims.values()) == set(files.values())

    shutil.rmtree(m.path / "ck")
    wait_for(lambda: "ck" not in manifests(view), timeout=60, what="manifest deletion")

    def gc_tried():
        if not all(v.exists() for v in victims):
            return True  # deleted through the symlink: the assertion below says so
        err = ckptfs.status(m.path)["tiering"]["store"]["last_error"] or ""
        return "symlink" in err
    wait_for(gc_tried, timeout=60, what="GC to try the objects' deletion")
    for victim, data in victims.items():
        assert victim.exists(), f"{victim} outside the store was deleted through a symlink"
        assert victim.read_bytes() == data
    err = ckptfs.status(m.path)["tiering"]["store"]["last_error"]
    assert "a symlink is in the way" in err and keys[0].split("/")[1] in err, err
    assert not m.unexpected_errors(), m.unexpected_errors()
