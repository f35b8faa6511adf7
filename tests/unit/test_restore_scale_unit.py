"""The --prefetch option of restore at scale, without a mount (the restores themselves:
tests/multinode/test_restore_scale.py): it takes one of the policies, exit 2 and one line naming
the option otherwise, nothing touched; --no-prefetch is --prefetch none; the config refuses
anything else.
"""

from __future__ import annotations

import pytest


def test_prefetch_option_is_validated(tmp_path):
    """--prefetch takes one of the policies (exit 2, one line naming the option, nothing
    touched); --no-prefetch is --prefetch none; the config refuses anything else."""
    from ckptfs.cli import build_parser
    from ckptfs.config import ConfigError, MountConfig
    from tests.conftest import run_cli

    mp_, cache = tmp_path / "mp", tmp_path / "cache"
    mp_.mkdir()
    res = run_cli("mount", str(mp_), "--cache-dir", str(cache), "--prefetch", "everything")
    lines = res.stderr.splitlines()
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("ckptfs: "), res
    assert "--prefetch" in lines[0] and "Traceback" not in res.stderr
    assert not cache.exists()
    parse = build_parser().parse_args
    assert parse(["mount", str(mp_)]).prefetch == "auto"
    assert parse(["mount", str(mp_), "--no-prefetch"]).prefetch == "none"
    assert parse(["mount", str(mp_), "--prefetch", "READS"]).prefetch == "reads"
    assert MountConfig(mountpoint=mp_, cache_dir=cache, prefetch="file").prefetch == "file"
    with pytest.raises(ConfigError, match="--prefetch"):
        MountConfig(mountpoint=mp_, cache_dir=cache, prefetch="everything")
