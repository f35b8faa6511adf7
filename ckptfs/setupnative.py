"""`ckptfs setup-native`: build and install the FUSE passthrough binding (libfuse 3.17.2 and a
patched pyfuse3 3.5.0, docs/ARCHITECTURE.md "Data path") into a Python environment, the same
build `scripts/setup.sh` runs for a clone, for a `pip install`ed ckptfs.

The build is `ckptfs/native/build.sh`, shipped in the package: it needs apt (`apt-get source`
of Debian 13's fuse3, signed by Debian's keys), a C compiler, the Python headers and
pkg-config, and caches what it built once per machine (`CKPTFS_BUILD_CACHE`, default
/var/cache/ckptfs-build). It never breaks the environment: if a step fails, the PyPI pyfuse3
stays and ckptfs serves file data in the daemon (`ckptfs status` says which data path runs).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

BUILD_SCRIPT = Path(__file__).resolve().parent / "native" / "build.sh"
# what the patched binding adds (build.sh checks the same names)
_PROBE = "import pyfuse3; pyfuse3.passthrough_open, pyfuse3.killpriv_v2_active"

EXIT_READY = 0      # the environment's pyfuse3 has passthrough
EXIT_FAILED = 1     # the build failed (build.sh named the step and its log); nothing changed
EXIT_USAGE = 2      # not an environment pip can install into


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser(
        "setup-native", help="build and install the FUSE passthrough binding (as root, once)",
        description="Build libfuse 3.17.2 and pyfuse3 3.5.0 with FUSE passthrough and install "
        "them into a Python environment (default: the one running ckptfs). Built once per "
        "machine, cached in $CKPTFS_BUILD_CACHE (default /var/cache/ckptfs-build); a second "
        "run, or another environment, takes seconds. Exit 0 when the binding is ready, 1 when "
        "the build failed (ckptfs then serves file data in the daemon), 2 when ENV is not an "
        "environment pip can install into.")
    s.add_argument("--venv", type=Path, default=Path(sys.prefix), metavar="ENV",
                   help="the environment to install into (default: %(default)s)")


def has_passthrough(env: Path) -> bool:
    """Whether ENV's Python loads a pyfuse3 with the passthrough API."""
    r = subprocess.run([str(env / "bin" / "python"), "-c", _PROBE],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return r.returncode == 0


def run(a: argparse.Namespace) -> int:
    env = a.venv.absolute()
    missing = [p for p in ("bin/python", "bin/pip") if not (env / p).exists()]
    if missing:
        print(f"ckptfs: {env} is not a Python environment pip can install into (no "
              f"{', '.join(missing)}); pass one with --venv", file=sys.stderr)
        return EXIT_USAGE
    # build.sh reports each step on stdout/stderr as `setup: ...` and never exits non-zero
    subprocess.run(["bash", str(BUILD_SCRIPT), str(env)])
    if has_passthrough(env):
        print(f"ckptfs: FUSE passthrough binding ready in {env}")
        return EXIT_READY
    print(f"ckptfs: the FUSE passthrough binding is not installed in {env} (the line above "
          f"says which step failed; details in {env / 'native' / 'build.log'})",
          file=sys.stderr)
    return EXIT_FAILED
