#!/usr/bin/env python3
"""A/B benchmark of the readers of stored objects, before and after a change to the decoder.

Builds a file:// store on a RAM-backed directory (/dev/shm) holding one object of SIZE bytes
twice, lz4-compressed (4 MiB frames, chunk CRCs) and uncompressed, then times, in interleaved
before/after pairs (the order alternates from one pair to the next):

  script     scripts/ckpt_restore.py restore (a child process, wall time)
  download   cachemgr.transfer.download.download_file in-process (trio; the time of the call)
  restore    `python -m ckptfs restore` (a child process, wall time)

"before" is a commit checked out in a temporary worktree (`git worktree add`, removed at the
end); "after" is this checkout. Each side runs with its own tree first on sys.path (checked:
the child prints where cachemgr came from). Prints, and writes to --out, a markdown table of
medians, min-max spread and after/before ratios.

    python scripts/bench_decode.py --before cf71c6e --pairs 5 --out docs/bench/decoder-issue22.md
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import crc32c
import lz4.frame

REPO = Path(__file__).resolve().parent.parent
FRAME = 4 << 20
NODE = "bench001"
CASES = ("script", "download", "restore")
KINDS = ("lz4", "none")

# The in-process download: argv = store dir, object JSON file, destination; prints seconds.
_DOWNLOAD = """
import json, sys, time
from pathlib import Path
import trio
import cachemgr
from cachemgr.format.objects import StoredObject
from cachemgr.store.local import LocalStore
from cachemgr.transfer.download import download_file
assert cachemgr.__file__.startswith(sys.argv[4]), cachemgr.__file__
obj = StoredObject.from_json(json.loads(open(sys.argv[2]).read()))
store = LocalStore(Path(sys.argv[1]))
async def main() -> float:
    t = time.perf_counter()
    await download_file(store, obj, sys.argv[3])
    return time.perf_counter() - t
print(trio.run(main))
"""


def _data(size: int, seed: int) -> bytes:
    """Alternating 256 KiB of random bytes and of zeros: lz4 ratio about 2."""
    rng = random.Random(seed)
    out = bytearray(size)
    for off in range(0, size, 512 << 10):
        n = min(256 << 10, size - off)
        out[off:off + n] = rng.randbytes(n)
    return bytes(out)


def _put(root: Path, key: str, data: bytes) -> None:
    p = root / "objects" / key
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)


def make_store(root: Path, size: int) -> dict[str, dict[str, object]]:
    """Two file sets, `bench/<kind>.bin`, one object each; returns {kind: object JSON}."""
    data = _data(size, 1)
    chunks = [data[i:i + FRAME] for i in range(0, size, FRAME)]
    crcs = [crc32c.crc32c(c) for c in chunks]
    whole = crc32c.crc32c(data)
    objs: dict[str, dict[str, object]] = {}
    for kind in KINDS:
        key = f"data/{NODE}/1/{len(objs) + 1}/{kind}.bin"
        obj: dict[str, object] = {"key": key, "size": size, "crc32c": whole,
                                  "compression": kind, "frame_size": 0, "frames": None,
                                  "chunk_size": FRAME, "chunk_crcs": crcs}
        if kind == "lz4":
            stored = [lz4.frame.compress(c, block_size=lz4.frame.BLOCKSIZE_MAX1MB,
                                         content_checksum=False, store_size=True)
                      for c in chunks]
            obj.update(frame_size=FRAME, frames=[len(s) for s in stored])
            blob = b"".join(stored)
        else:
            blob = data
        obj["stored_size"] = len(blob)
        _put(root, key, blob)
        path = f"bench/{kind}.bin"
        manifest = {"format": "ckptfs-manifest", "version": 1, "path": path, "kind": "file",
                    "commit": {"node": NODE, "seq": len(objs) + 1, "reason": "request",
                               "committed_ns": 1},
                    "total_bytes": size,
                    "files": [{"path": "", "size": size, "mode": 0o644, "mtime_ns": 1,
                               "object": obj}],
                    "dirs": [], "symlinks": []}
        _put(root, f"manifests/{path}.json", json.dumps(manifest).encode())
        objs[kind] = obj
    return objs


def _env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}


def run_once(case: str, kind: str, tree: Path, store: Path, objfile: Path, work: Path) -> float:
    """Seconds for one run of `case` on object `kind` with the code of `tree`."""
    dest = work / "dest"
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir()
    py = sys.executable
    if case == "download":
        r = subprocess.run([py, "-c", _DOWNLOAD, str(store), str(objfile), str(dest / "out"),
                            str(tree)], env=_env(tree), capture_output=True, text=True,
                           check=False, timeout=600, cwd=work)  # not the caller's tree first
        if r.returncode != 0:
            raise SystemExit(f"download ({tree}) failed: {r.stderr[-2000:]}")
        secs = float(r.stdout.split()[-1])
    else:
        if case == "script":
            cmd = [py, str(tree / "scripts" / "ckpt_restore.py"), "restore", f"file://{store}",
                   f"bench/{kind}.bin", str(dest)]
        else:
            cmd = [py, "-m", "ckptfs", "restore", f"file://{store}", f"bench/{kind}.bin",
                   str(dest)]
        t = time.perf_counter()
        r = subprocess.run(cmd, env=_env(tree), capture_output=True, text=True, check=False,
                           timeout=600, cwd=work)
        secs = time.perf_counter() - t
        if r.returncode != 0:
            raise SystemExit(f"{case} ({tree}) failed: {r.stderr[-2000:]}")
    shutil.rmtree(dest, ignore_errors=True)
    return secs


def _origin(tree: Path) -> str:
    code = "import cachemgr, ckptfs; print(cachemgr.__file__, ckptfs.__file__)"
    r = subprocess.run([sys.executable, "-c", code],
                       env=_env(tree), capture_output=True, text=True, check=True, cwd="/")
    return r.stdout.strip()


def _fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"


def table(results: dict[tuple[str, str, str], list[float]], size: int, pairs: int,
          before: str, after: str) -> str:
    head = (f"Object of {size >> 20} MiB in a file:// store on /dev/shm, {pairs} interleaved "
            f"before/after pairs; seconds, median (min-max); before = {before}, after = "
            f"{after}.")
    lines = [head, "",
             "| reader | object | before s | after s | after/before (median) |",
             "|---|---|---:|---:|---:|"]
    for case in CASES:
        for kind in KINDS:
            b, a = results[(case, kind, "before")], results[(case, kind, "after")]
            ratio = statistics.median(a) / statistics.median(b)
            lines.append(f"| {case} | {kind} | {_fmt(b)} | {_fmt(a)} | {ratio:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True, help="the commit to compare against")
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--size-mib", type=int, default=256)
    p.add_argument("--shm", type=Path, default=Path("/dev/shm"))
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--before-tree", type=Path, default=Path("/tmp/dec-before"),
                   help="where the temporary worktree of --before goes (must not exist)")
    a = p.parse_args()
    size = a.size_mib << 20
    before_tree = a.before_tree
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(before_tree),
                    a.before], check=True, capture_output=True)
    work = Path(tempfile.mkdtemp(prefix="bench-decode-", dir=a.shm))
    try:
        trees = {"before": before_tree, "after": REPO}
        for side, tree in trees.items():
            print(f"{side}: {_origin(tree)}", flush=True)
        store = work / "store"
        objs = make_store(store, size)
        objfiles = {}
        for kind, obj in objs.items():
            objfiles[kind] = work / f"{kind}.json"
            objfiles[kind].write_text(json.dumps(obj))
        results: dict[tuple[str, str, str], list[float]] = {}
        for i in range(a.pairs):
            order = ("before", "after") if i % 2 == 0 else ("after", "before")
            for case in CASES:
                for kind in KINDS:
                    for side in order:
                        s = run_once(case, kind, trees[side], store, objfiles[kind], work)
                        results.setdefault((case, kind, side), []).append(s)
                        print(f"pair {i + 1} {case:8} {kind:4} {side:6} {s:.3f}s", flush=True)
        after = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                               check=True, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--",
                                "cachemgr", "ckptfs", "scripts"],
                               check=True, capture_output=True, text=True).stdout.strip()
        out = table(results, size, a.pairs, a.before,
                    after + (" + uncommitted changes" if dirty else ""))
        print(out)
        if a.out is not None:
            a.out.write_text(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force",
                        str(before_tree)], check=False, capture_output=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
