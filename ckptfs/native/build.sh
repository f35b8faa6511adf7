#!/usr/bin/env bash
# Build the FUSE binding with kernel passthrough (docs/ARCHITECTURE.md "Data path"):
#   libfuse 3.17.2 (Debian 13's source package, fetched with `apt-get source` through a private
#   sources list: the machine's own apt configuration is not touched), installed under
#   $VENV/native/libfuse, and pyfuse3 3.5.0 (PyPI sdist) with ckptfs/native/pyfuse3-3.5.0-
#   passthrough.patch, linked against that libfuse with an rpath, installed into $VENV.
#
# Usage: build.sh VENV (what `ckptfs setup-native [--venv VENV]` runs). Built once per machine:
# libfuse and the pyfuse3 wheel go to $CKPTFS_BUILD_CACHE/<hash of the inputs> (default
# /var/cache/ckptfs-build, or ~/.cache/ckptfs-build where that is not writable), under a lock,
# and every virtual environment (a fresh clone's too) installs that wheel, whose rpath names that
# libfuse: a few seconds instead of ~40. Idempotent: a stamp in $VENV/native records what the
# venv got (the pinned versions and hashes, the patch, this script); a second run with the same
# inputs does nothing. Deleting the build cache is safe: the next setup finds the venv's pyfuse3
# cannot load and builds again.
# Never fatal: if any step fails, it says why in one line, leaves the PyPI pyfuse3 in place and
# exits 0, and ckptfs runs its user-space data path (`ckptfs status` shows the mode).
# CKPTFS_NO_NATIVE_BUILD=1 skips it.
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$(realpath -m "$1")"  # absolute: the steps below cd
NATIVE="$VENV/native"
LIBFUSE_VERSION=3.17.2
LIBFUSE_SHA256=3d932431ad94e86179e5265cddde1d67aa3bb2fb09a5bd35c641f86f2b5ed06f
PYFUSE3_VERSION=3.5.0
PYFUSE3_SHA256=88399a9494b88603230bba300f4ba9ad63fece5ed514ca3633d555a0c6a42b24
PATCH="$HERE/pyfuse3-3.5.0-passthrough.patch"
# The local version label marks the patched build; pip sees it as satisfying pyfuse3>=3.3,<4.
WHEEL_VERSION="$PYFUSE3_VERSION+ckptfs.passthrough3"

[ "${CKPTFS_NO_NATIVE_BUILD:-0}" = "1" ] && { echo "setup: native build skipped (CKPTFS_NO_NATIVE_BUILD=1)"; exit 0; }

# The inputs, and the interpreter the wheel is built for (its ABI tag and machine).
abi="$("$VENV/bin/python" -c 'import sys, platform; print(sys.implementation.cache_tag, platform.machine())')"
want="$( (echo "$LIBFUSE_VERSION $LIBFUSE_SHA256 $PYFUSE3_VERSION $PYFUSE3_SHA256 $WHEEL_VERSION $abi";
          cat "$PATCH" "${BASH_SOURCE[0]}") | sha256sum | cut -d' ' -f1)"
stamp="$NATIVE/.stamp"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
   && "$VENV/bin/python" -c "import pyfuse3; pyfuse3.passthrough_open, pyfuse3.killpriv_v2_active, pyfuse3.Operations.fallocate" 2>/dev/null; then
    exit 0
fi

fail() {
    echo "setup: FUSE passthrough build failed ($*); ckptfs will use its user-space data path" >&2
    echo "setup: (details in $log)" >&2
    exit 0
}
log="$NATIVE/build.log"
mkdir -p "$NATIVE" || fail "cannot create $NATIVE"
: > "$log"
cache_root="${CKPTFS_BUILD_CACHE:-/var/cache/ckptfs-build}"
if ! { mkdir -p "$cache_root" && [ -w "$cache_root" ]; } 2>/dev/null; then
    cache_root="${XDG_CACHE_HOME:-$HOME/.cache}/ckptfs-build"
    mkdir -p "$cache_root" || fail "cannot create $cache_root"
fi
BUILT="$cache_root/$want"  # libfuse/, wheels/, .done: what one build of these inputs made
exec 9>"$cache_root/.lock" && flock 9 || fail "cannot lock $cache_root/.lock"  # one build at a time

install_wheel() {
    local whl
    whl="$(ls "$BUILT"/wheels/pyfuse3-*.whl 2>/dev/null | head -n 1)"
    [ -n "$whl" ] || return 1
    # Replace whatever pyfuse3 is there, then let pip add what it needs (trio).
    "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps --force-reinstall "$whl" >>"$log" 2>&1 \
        && "$VENV/bin/pip" install -q --disable-pip-version-check "$whl" >>"$log" 2>&1 || return 1
    "$VENV/bin/python" - "$BUILT/libfuse" >>"$log" 2>&1 <<'EOF'
import sys, pyfuse3
pyfuse3.passthrough_open, pyfuse3.killpriv_v2_active, pyfuse3.Operations.fallocate  # the patched API
maps = open("/proc/self/maps").read()
assert sys.argv[1] + "/lib/libfuse3.so" in maps, "libfuse not loaded from " + sys.argv[1]
EOF
}

if [ -f "$BUILT/.done" ] && install_wheel; then
    echo "$want" > "$stamp"
    echo "setup: FUSE passthrough binding installed from the build cache ($BUILT)"
    exit 0
fi
echo "setup: building libfuse $LIBFUSE_VERSION and pyfuse3 $PYFUSE3_VERSION with FUSE passthrough (once, into $BUILT)"
rm -rf "$BUILT" && mkdir -p "$BUILT" || fail "cannot create $BUILT"
work="$BUILT/src"
mkdir -p "$work" || fail "cannot create $work"

# 1. libfuse: the Debian 13 (trixie) source package, signed by Debian's archive keys.
apt_dir="$BUILT/apt"
mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial"
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
[ -r "$keyring" ] || fail "no $keyring (package debian-archive-keyring)"
echo "deb-src [signed-by=$keyring] http://deb.debian.org/debian trixie main" > "$apt_dir/sources.list"
apt_opts=(-o "Dir::Etc::SourceList=$apt_dir/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
          -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache"
          -o "APT::Sandbox::User=root")
apt-get "${apt_opts[@]}" update >>"$log" 2>&1 || fail "apt-get update of the trixie sources"
(cd "$work" && apt-get "${apt_opts[@]}" source --download-only "fuse3=$LIBFUSE_VERSION-*" >>"$log" 2>&1) \
    || (cd "$work" && apt-get "${apt_opts[@]}" source --download-only fuse3 >>"$log" 2>&1) \
    || fail "apt-get source fuse3"
tarball="$work/fuse3_$LIBFUSE_VERSION.orig.tar.gz"
[ -f "$tarball" ] || fail "fuse3 $LIBFUSE_VERSION is no longer in trixie"
echo "$LIBFUSE_SHA256  $tarball" | sha256sum -c --quiet >>"$log" 2>&1 || fail "fuse3 tarball checksum"
tar xzf "$tarball" -C "$work" || fail "unpacking fuse3"

# Build tools in their own virtual environment (not the runtime one).
tools="$cache_root/tools"
if [ ! -x "$tools/bin/meson" ]; then
    python3 -m venv "$tools" >>"$log" 2>&1 || fail "venv for the build tools"
    "$tools/bin/pip" install -q --disable-pip-version-check meson ninja >>"$log" 2>&1 \
        || fail "pip install meson ninja"
fi
prefix="$BUILT/libfuse"
(cd "$work/fuse-$LIBFUSE_VERSION" \
    && PATH="$tools/bin:$PATH" meson setup build --prefix="$prefix" --libdir=lib \
        -Dexamples=false -Dutils=false -Dtests=false -Duseroot=false >>"$log" 2>&1 \
    && PATH="$tools/bin:$PATH" ninja -C build install >>"$log" 2>&1) || fail "building libfuse"
[ -f "$prefix/lib/pkgconfig/fuse3.pc" ] || fail "libfuse installed no fuse3.pc"

# 2. pyfuse3: the PyPI sdist, checked, patched, built against that libfuse.
(cd "$work" && "$VENV/bin/pip" download -q --disable-pip-version-check --no-deps --no-binary :all: \
    "pyfuse3==$PYFUSE3_VERSION" -d . >>"$log" 2>&1) || fail "pip download pyfuse3"
sdist="$work/pyfuse3-$PYFUSE3_VERSION.tar.gz"
echo "$PYFUSE3_SHA256  $sdist" | sha256sum -c --quiet >>"$log" 2>&1 || fail "pyfuse3 sdist checksum"
tar xzf "$sdist" -C "$work" || fail "unpacking pyfuse3"
src="$work/pyfuse3-$PYFUSE3_VERSION"
(cd "$src" && patch -p1 -s < "$PATCH" >>"$log" 2>&1) || fail "applying the pyfuse3 patch"
rm -f "$src/src/pyfuse3/__init__.c"  # generated from the patched .pyx by Cython
wheels="$BUILT/wheels"
(cd "$src" && PKG_CONFIG_PATH="$prefix/lib/pkgconfig" LDFLAGS="-Wl,-rpath,$prefix/lib" \
    SETUPTOOLS_SCM_PRETEND_VERSION="$WHEEL_VERSION" \
    "$VENV/bin/pip" wheel -q --disable-pip-version-check --no-deps -w "$wheels" . >>"$log" 2>&1) \
    || fail "building pyfuse3"
install_wheel || fail "installing the pyfuse3 wheel (or it does not load the built libfuse)"
rm -rf "$work" "$apt_dir"
touch "$BUILT/.done"
echo "$want" > "$stamp"
echo "setup: FUSE passthrough binding ready (libfuse $LIBFUSE_VERSION in $prefix)"
