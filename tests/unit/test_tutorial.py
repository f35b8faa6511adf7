"""docs/TUTORIAL.md runs as written: its `train.py` and its one-machine shell block, extracted
from the page, through real mounts (node A trains and dies with its cache, node B resumes on an
empty cache from the store), so the tutorial cannot drift from what ckptfs does."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from tests.conftest import REPO, require_fuse

PAGE = REPO / "docs" / "TUTORIAL.md"


def block(marker: str) -> str:
    """The fenced code block right after `<!-- tutorial:MARKER -->` on the page."""
    m = re.search(rf"<!-- tutorial:{re.escape(marker)} -->\n```\w+\n(.*?)\n```", PAGE.read_text(),
                  re.S)
    assert m, f"no block {marker} in {PAGE}"
    return m.group(1) + "\n"


def _cleanup(mountpoints: list[Path]) -> None:
    for mp in mountpoints:
        if os.path.ismount(mp):
            subprocess.run([sys.executable, "-m", "ckptfs", "umount", str(mp), "--no-wait"],
                           capture_output=True, timeout=60)
        if os.path.ismount(mp):
            subprocess.run(["fusermount3", "-uz", str(mp)], capture_output=True, timeout=30)


def test_tutorial_one_machine(tmp_path):
    require_fuse()
    (tmp_path / "train.py").write_text(block("train.py"))
    script = block("one-machine")
    t = tmp_path / "t"
    env = dict(os.environ, T=str(t),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    try:
        r = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=600)
    finally:
        _cleanup([t / "node-a", t / "node-b"])
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    # node A saved three checkpoints, node B listed them and resumed from the newest
    assert r.stdout.count("saved step_") == 5, out
    assert "saved step_30.pt" in r.stdout and "resumed from step_30.pt at step 30" in r.stdout
    listing = r.stdout.split("resumed from")[0].split("saved step_30.pt")[-1].split()
    assert {"step_10.pt", "step_20.pt", "step_30.pt"} <= set(listing), out
    assert "saved step_50.pt" in r.stdout.split("resumed from")[1]
    assert not (t / "cache-a").exists()
    # what node B saved is in the store, whole: a third mount with an empty cache loads it, and
    # it equals what an uninterrupted run of the same script saves
    ref_dir = t / "uninterrupted"
    ref_dir.mkdir()
    ref = subprocess.run([sys.executable, str(tmp_path / "train.py"), "--ckpt-dir", str(ref_dir),
                          "--steps", "50"], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    c = t / "node-c"
    c.mkdir()
    try:
        r = subprocess.run([sys.executable, "-m", "ckptfs", "mount", str(c), "--store",
                            f"file://{t / 'store'}", "--cache-dir", str(t / "cache-c")],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert sorted(os.listdir(c), key=lambda f: int(f[5:-3])) == \
            [f"step_{n}.pt" for n in (10, 20, 30, 40, 50)]
        assert_same_state(torch.load(c / "step_50.pt"), torch.load(ref_dir / "step_50.pt"))
    finally:
        _cleanup([c])


def assert_same_state(got: dict, want: dict) -> None:
    assert got["step"] == want["step"] == 50
    assert torch.equal(got["rng"], want["rng"])
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), k
    for i, st in want["opt"]["state"].items():
        for k, v in st.items():
            assert torch.equal(got["opt"]["state"][i][k], v), (i, k)
