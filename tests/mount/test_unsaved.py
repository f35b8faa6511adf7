"""Files written under a mount that no set holds are said, never silently left behind (issue
39; docs/SEMANTICS.md "Files written into a committed directory", "Files in no set"), through
a real mount:

  * Megatron-core's order on one mount — DCP's `.metadata` rename commits `iter_N/`, then
    `metadata.json` and `integrity.json` are written into it, then the tracker file is
    rewritten in place: `ckptfs wait` on the checkpoint root exits 0 and the store's manifest
    of `iter_N` names the late files (the fresh-node load:
    tests/multinode/test_frameworks_megatron_ds.py);
  * a temporary file never renamed and a DCP directory whose `.metadata` never came: `status`
    (plain and --json) names them as at risk and never says only "every committed set is
    durable"; `ckptfs umount` unmounts, names them and exits 12; a remount shows them;
    `--allow-unsaved` exits 0.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from ckptfs.mount import EXIT_OK, EXIT_UNSAVED
from tests.conftest import run_cli
from tests.status_helpers import status


def store_manifest(m, set_path: str) -> dict:
    """The manifest of `set_path` in the mount's file:// store (docs/FORMAT.md)."""
    return json.loads((m.store_dir / "objects" / "manifests" / f"{set_path}.json").read_text())


def test_megatron_s_late_files_are_in_the_store_when_wait_returns(mnt):
    root = mnt.path / "ckpt"
    it = root / "iter_0000006"
    it.mkdir(parents=True)
    state = {"w": torch.arange(1000, dtype=torch.float32), "step": torch.tensor(6)}
    dcp.save(state, checkpoint_id=str(it))  # one process: no process group needed
    (it / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (it / "integrity.json").write_text('{"algorithm": "sha256"}')
    (root / "latest_checkpointed_iteration.txt").write_text("6")
    res = run_cli("wait", str(root), "--timeout", "120")
    assert res.returncode == EXIT_OK, res.stdout + res.stderr
    m = store_manifest(mnt, "ckpt/iter_0000006")
    names = {f["path"] for f in m["files"]}
    assert {"metadata.json", "integrity.json", ".metadata"} <= names, names
    assert m["commit"]["reason"] == "amend"
    t = status(mnt)["tiering"]
    assert t["unsaved_files"] == 0 and t["pending_sets"] == 0, t


def test_files_in_no_set_are_at_risk_in_status_and_umount(mount_factory):
    m = mount_factory()
    m.start()
    (m.path / "model.pt.tmp").write_bytes(b"m" * 200)
    shards = m.path / "step_9"
    shards.mkdir()
    (shards / "__0_0.distcp").write_bytes(b"s" * 300)
    (m.path / "done.pt").write_bytes(b"d" * 10)   # a set of its own
    res = run_cli("wait", str(m.path / "done.pt"), "--timeout", "120")
    assert res.returncode == EXIT_OK, res.stderr

    t = status(m)["tiering"]
    assert (t["unsaved_files"], t["unsaved_bytes"]) == (2, 500), t
    assert sorted(t["unsaved"]) == ["model.pt.tmp", "step_9/__0_0.distcp"]
    plain = run_cli("status", str(m.path))
    assert plain.returncode == EXIT_OK
    risk = plain.stdout[plain.stdout.index("at risk"):]
    assert "500 B in 2 files in no committed set" in risk, plain.stdout
    assert "model.pt.tmp" in risk and "step_9/__0_0.distcp" in risk
    assert "0 B in 0 sets" not in plain.stdout

    res = run_cli("umount", str(m.path))
    assert res.returncode == EXIT_UNSAVED, res.stdout + res.stderr
    err = res.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith("ckptfs: unmounted"), err
    assert "2 files in no committed set" in err and "model.pt.tmp" in err
    assert "in no committed set stay only in this cache dir" in m.log_text()
    m.pid = None

    m.start()  # the cache dir keeps them: the remount shows them, still at risk
    assert Path(m.path / "model.pt.tmp").read_bytes() == b"m" * 200
    assert status(m)["tiering"]["unsaved_files"] == 2
    res = run_cli("umount", str(m.path), "--allow-unsaved")
    assert res.returncode == EXIT_OK, res.stderr
    m.pid = None
