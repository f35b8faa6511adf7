"""`ckptfs ls`, `ckptfs restore`, `ckptfs fsck`, the store tools that need no mount, on stores
nothing mounted wrote (the tools on what real mounts wrote: tests/mount/test_storetools.py): an
unusable store exits 7 in one line, the store view is the store layer with its bounds, usage
errors and a set that does not exist, a restore of a large file in bounded memory.
"""

from __future__ import annotations

import json
import subprocess
import sys

import crc32c
import pytest

from cachemgr.format import keys, readerrors, storeview
from ckptfs import storetools
from tests.conftest import REPO, run_cli
from tests.storetools_helpers import DEAD, one_line, put

# -- errors: one line, documented codes ---------------------------------------------------------

def test_an_unusable_store_exits_7_in_one_line(tmp_path, s3_bucket):
    import socket

    endpoint, _ = s3_bucket
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    cases = [[f"file://{tmp_path}/nothing"],
             ["s3://no-such-bucket-here/p", "--s3-endpoint", endpoint],
             ["s3://bucket/p", "--s3-endpoint", dead]]
    for store in cases:
        for cmd in (["ls"], ["fsck"], ["restore"]):
            args = [*cmd, store[0], *(["ckpt/x", str(tmp_path / "d")] if cmd == ["restore"]
                                      else []), *store[1:]]
            r = run_cli(*args)
            assert r.returncode == 7 and one_line(r.stderr), (args, r.stderr)
            assert "unusable" in r.stderr
    assert not (tmp_path / "nothing").exists()  # a missing file:// store is not created
    assert not (tmp_path / "d").exists()


def test_the_store_view_is_the_store_layer_with_its_bounds(tmp_path):
    """cachemgr.format.storeview: the tools' blocking face of cachemgr.store. An absent key is
    None, a document past its bound and a short ranged read are CorruptError, every failure of
    the store one readerrors.StoreError, and reads go through the store (its wrappers too)."""
    from cachemgr.store import LocalStore, StoreError
    from tests.faultstore import FaultyStore

    loop = storeview.StoreLoop()
    store = FaultyStore(LocalStore(tmp_path / "store"))
    try:
        view = storeview.ObjectStoreView(loop, store, "file:///test")
        view.call(store.put, "manifests/a", b"x" * 10)
        assert view.listing("manifests/") == [("manifests/a", 10)]
        assert view.get("manifests/a", max_bytes=10) == b"x" * 10
        with pytest.raises(readerrors.CorruptError, match="more than 9 bytes"):
            view.get("manifests/a", max_bytes=9)
        assert view.get("manifests/b") is None and view.open("manifests/b") is None
        r = view.open("manifests/a")
        assert r is not None and (r.key, r.size) == ("manifests/a", 10)
        assert r.read(2, 3) == b"xxx" and r.read(0, 0) == b""
        with pytest.raises(readerrors.CorruptError, match="shorter than it was"):
            r.read(8, 4)
        store.fail_next("get", 1, StoreError("injected: access denied"))
        with pytest.raises(readerrors.StoreError, match="file:///test: injected: access denied"):
            view.get("manifests/a")
        assert store.injected == {"get": 1}
        view.delete("manifests/a")
        assert view.head("manifests/a") is None
    finally:
        loop.call(store.aclose)
        loop.close()


def test_usage_and_no_such_set(tmp_path):
    (tmp_path / "store" / "objects").mkdir(parents=True)
    url = f"file://{tmp_path}/store"
    r = run_cli("restore", url, "ckpt/none", str(tmp_path / "d"))
    assert r.returncode == storetools.EXIT_NO_SET and one_line(r.stderr), r.stderr
    for args in (["ls", "http://x/y"], ["fsck", "file://relative"], ["ls", "s3://"],
                 ["restore", url, "../up", str(tmp_path / "d")],
                 ["fsck", url, "--older-than", "nan"], ["restore", url, "x", "d", "--parallel",
                                                         "0"]):
        r = run_cli(*args)
        assert r.returncode == 2 and one_line(r.stderr), (args, r.stderr)
    r = run_cli("fsck", url)
    assert r.returncode == 0 and "0 manifests" in r.stdout


# -- bounded memory -----------------------------------------------------------------------------

def test_restore_of_a_large_file_runs_in_bounded_memory(tmp_path):
    """A 512 MiB file (lz4 frames of zeros) restored with 8 ranged reads in flight: the
    process's peak RSS stays far below the file (about READ_BYTES x 2 per worker above the
    interpreter with boto3 and trio loaded)."""
    import lz4.frame

    size, frame = 512 << 20, 4 << 20
    store = tmp_path / "store"
    key = f"data/{DEAD}/1/1/big.pt"
    z = lz4.frame.compress(bytes(frame))
    (store / "objects" / key).parent.mkdir(parents=True)
    with open(store / "objects" / key, "wb") as f:
        f.writelines(z for _ in range(size // frame))
    whole = 0
    for _ in range(size // frame):
        whole = crc32c.crc32c(bytes(frame), value=whole)
    o = {"key": key, "size": size, "stored_size": len(z) * (size // frame), "crc32c": whole,
         "compression": "lz4", "frame_size": frame, "frames": [len(z)] * (size // frame),
         "chunk_size": frame, "chunk_crcs": [crc32c.crc32c(bytes(frame))] * (size // frame)}
    doc = {"format": "ckptfs-manifest", "version": 1, "path": "big.pt", "kind": "file",
           "commit": {"node": DEAD, "seq": 1, "reason": "close", "committed_ns": 1},
           "total_bytes": size, "files": [{"path": "", "size": size, "mode": 0o644,
                                           "mtime_ns": 1, "object": o}],
           "dirs": [], "symlinks": []}
    put(store, keys.manifest_key("big.pt"), json.dumps(doc).encode())
    probe = ("import sys\n"
             "from ckptfs import cli\n"
             "rc = cli.main(sys.argv[1:])\n"
             "hwm = [ln for ln in open('/proc/self/status') if ln.startswith('VmHWM:')]\n"
             "print(hwm[0].split()[1], file=sys.stderr)\n"
             "sys.exit(rc)\n")
    r = subprocess.run([sys.executable, "-c", probe, "restore", f"file://{store}", "big.pt",
                        str(tmp_path / "d")], check=False, capture_output=True, text=True,
                       timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr
    peak_mib = int(r.stderr.split()[-1]) // 1024
    assert peak_mib < 200, f"peak RSS {peak_mib} MiB"
    assert (tmp_path / "d" / "big.pt").stat().st_size == size
