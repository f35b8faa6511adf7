"""The wheel a user installs: what it holds, what it requires, and that it installs into an
environment with the user's own torch without touching it, then builds the passthrough binding
there with `ckptfs setup-native` (README "Install with pip").

Offline: the fresh environment sees the suite's dependencies through a .pth file (every package
of this virtual environment except ckptfs itself and torch), so pip resolves ckptfs's
requirements as installed, and a torch requirement would have to be met by the fake "user's
torch" in the environment's own site-packages (it is not: pip would fail with no index).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement

from tests.conftest import IN_CI, REPO

USER_TORCH = "2.99.0+user"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of this checkout, built from the files git would commit (not the working tree's
    build leftovers), without network."""
    src = tmp_path_factory.mktemp("src")
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=REPO, capture_output=True, check=True).stdout.decode().split("\0")
    for f in filter(None, files):
        if not (REPO / f).exists():   # deleted in the working tree, not yet committed
            continue
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, src / f, follow_symlinks=False)
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                        "--no-build-isolation", "--disable-pip-version-check", "-w", str(out),
                        str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = out.glob("ckptfs-*.whl")
    return whl


def _metadata(whl: Path) -> tuple[list[str], list[str]]:
    with zipfile.ZipFile(whl) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        text = z.read(name).decode()
    requires = [v for k, _, v in (ln.partition(": ") for ln in text.splitlines())
                if k == "Requires-Dist"]
    classifiers = [v for k, _, v in (ln.partition(": ") for ln in text.splitlines())
                   if k == "Classifier"]
    return requires, classifiers


def _needed(requires: list[str], extra: str) -> dict[str, Requirement]:
    """The requirements pip installs for `ckptfs` (extra '') or `ckptfs[extra]`."""
    out = {}
    for line in requires:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": extra}):
            out[req.name.lower()] = req
    return out


def test_wheel_contents(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        build = z.getinfo("ckptfs/native/build.sh")
    for want in ("ckptfs/py.typed", "cachemgr/py.typed", "cachemgr/core/schema.sql",
                 "ckptfs/native/build.sh", "ckptfs/native/pyfuse3-3.5.0-passthrough.patch",
                 "ckptfs/setupnative.py"):
        assert want in names, want
    assert build.file_size > 1000
    assert not [n for n in names if n.startswith(("tests/", "scripts/", "docs/"))]
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"ckptfs", "cachemgr"}, top
    requires, classifiers = _metadata(wheel)
    assert "Typing :: Typed" in classifiers and "Topic :: System :: Filesystems" in classifiers
    base = _needed(requires, "")
    # the user's torch is theirs: not required by the package, pinned only for the suite
    assert "torch" not in base, base["torch"]
    assert str(_needed(requires, "test")["torch"].specifier) == "==2.13.0"
    assert not [r for r in requires if r.startswith("torch") and "test" not in r], requires
    # the floor the S3 store needs (cachemgr/store/s3.py: Config(request_checksum_calculation),
    # conditional PutObject / CompleteMultipartUpload)
    assert base["boto3"].specifier.contains("1.36.0")
    assert not base["boto3"].specifier.contains("1.35.99")
    for dep in ("pyfuse3", "trio", "lz4", "crc32c", "prometheus-client", "rich"):
        assert dep in base, dep
    assert Marker('extra == "test"').evaluate({"extra": "test"})


def _user_env(tmp: Path) -> Path:
    """A fresh environment holding a "user's torch" (a distribution named torch, version
    2.99.0+user) and, through a .pth file, every other package of the suite's environment."""
    env = tmp / "userenv"
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True, timeout=120)
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(subprocess.run([str(env / "bin" / "python"), "-c", purelib], capture_output=True,
                               text=True, check=True, cwd=tmp).stdout.strip())
    ours = Path(sysconfig.get_paths()["purelib"])
    deps = tmp / "deps"
    deps.mkdir()
    skip = ("ckptfs", "cachemgr", "__editable__", "torch", "pip", "_distutils_hack",
            "distutils-precedence.pth", "setuptools")
    for entry in ours.iterdir():
        if entry.name.lower().startswith(skip) or entry.suffix == ".pth":
            continue
        (deps / entry.name).symlink_to(entry)
    (site / "suite-deps.pth").write_text(f"{deps}\n")
    dist = site / f"torch-{USER_TORCH}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {USER_TORCH}\n")
    (dist / "INSTALLER").write_text("user\n")
    (dist / "RECORD").write_text("")
    return env


def _pip(env: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(env / "bin" / "python"), "-m", "pip", "--disable-pip-version-check",
                           *args], capture_output=True, text=True, timeout=600, cwd=env.parent)


def _torch_version(env: Path) -> str:
    return subprocess.run([str(env / "bin" / "python"), "-c",
                           "import importlib.metadata as m; print(m.version('torch'))"],
                          capture_output=True, text=True, check=True, cwd=env.parent).stdout.strip()


def test_installs_beside_the_users_torch_and_builds_native(wheel, tmp_path):
    env = _user_env(tmp_path)
    assert _torch_version(env) == USER_TORCH
    r = _pip(env, "install", "--no-index", str(wheel))
    assert r.returncode == 0, r.stdout + r.stderr
    assert _torch_version(env) == USER_TORCH   # untouched
    ckptfs = env / "bin" / "ckptfs"
    r = subprocess.run([str(ckptfs), "--version"], capture_output=True, text=True, timeout=60,
                       cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("ckptfs "), r.stdout + r.stderr
    # (from a directory of its own: `python -c` puts the working directory first on sys.path)
    where = subprocess.run([str(env / "bin" / "python"), "-c",
                            "import ckptfs, cachemgr; print(ckptfs.__file__, cachemgr.__file__)"],
                           capture_output=True, text=True, check=True, cwd=tmp_path).stdout
    assert where.count(str(env)) == 2, where     # the installed package, not the checkout
    assert list((env / "lib").glob("python*/site-packages/ckptfs/native/build.sh"))

    # setup-native into that environment: the binding from the machine's build cache
    # (scripts/setup.sh built it for this run), installed in the environment's own site-packages
    if not _suite_has_passthrough():
        if IN_CI:
            pytest.fail("the suite's environment has no passthrough binding (setup did not "
                        "build it)")
        pytest.skip("no passthrough binding in this environment (CKPTFS_NO_NATIVE_BUILD?)")
    env_vars = {k: v for k, v in os.environ.items() if k != "CKPTFS_NO_NATIVE_BUILD"}
    r = subprocess.run([str(ckptfs), "setup-native"], capture_output=True, text=True,
                       timeout=900, env=env_vars, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"FUSE passthrough binding ready in {env}" in r.stdout
    probe = ("import pyfuse3; pyfuse3.passthrough_open; print(pyfuse3.__file__)")
    loaded = subprocess.run([str(env / "bin" / "python"), "-c", probe], capture_output=True,
                            text=True, check=True, cwd=tmp_path).stdout
    assert loaded.startswith(str(env)), loaded
    assert _torch_version(env) == USER_TORCH
    # a second run: nothing to do, same answer
    r = subprocess.run([str(ckptfs), "setup-native"], capture_output=True, text=True,
                       timeout=120, env=env_vars)
    assert r.returncode == 0, r.stdout + r.stderr


def _suite_has_passthrough() -> bool:
    r = subprocess.run([sys.executable, "-c", "import pyfuse3; pyfuse3.passthrough_open"],
                       capture_output=True)
    return r.returncode == 0


def test_setup_native_refuses_what_is_not_an_environment(tmp_path):
    r = subprocess.run([sys.executable, "-m", "ckptfs", "setup-native", "--venv",
                        str(tmp_path / "nowhere")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    (line,) = r.stderr.splitlines()
    assert line.startswith("ckptfs: ") and "is not a Python environment" in line
    assert "Traceback" not in r.stderr and not (tmp_path / "nowhere").exists()
