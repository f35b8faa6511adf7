"""The file:// store trusts nothing it reads from its directory (cachemgr/store/local.py):

  * symlinks anywhere under the root are never followed, by any operation: a planted symlink
    to a directory outside the store never lets a put write, a get/head read, a delete or an
    abort remove, or a listing report anything outside it; the operation fails with a permanent
    StoreError naming the key and the symlink (a listing skips it);
  * sidecars are untrusted: any malformed one reads as "no CRC known", never as an exception;
  * files are created 0600 and directories 0700 whatever the umask.

These tests drive LocalStore directly; two real mounts check that a daemon keeps serving (and a
fresh mount starts) over malformed sidecars, and that its GC deletes nothing outside the store
through a planted symlink: tests/mount/test_localstore_trust_mount.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import threading
from pathlib import Path

import pytest
import trio

from cachemgr.store import LocalStore, NotFound, StoreError, crc32c
from tests.localstore_helpers import sidecar


def run(fn, *args):
    return trio.run(fn, *args)


def assert_symlink_refused(excinfo, key: str) -> None:
    e = excinfo.value
    assert type(e) is StoreError, repr(e)  # not NotFound/PreconditionFailed, not transient
    assert not e.transient
    assert "symlink" in str(e) and key in str(e), str(e)


@pytest.fixture
def env(tmp_path):
    """(store, store root, a directory outside the store)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    return LocalStore(tmp_path / "store"), tmp_path / "store", outside


# ----------------------------------------------------------------------------------------------
# symlinks


@pytest.fixture
def linked_dir(env):
    """objects/data/n1 is a symlink to a directory outside holding v1/obj (a victim file)."""
    store, root, outside = env
    (outside / "v1").mkdir()
    (outside / "v1" / "obj").write_bytes(b"outside data")
    (root / "objects" / "data").mkdir()
    (root / "objects" / "data" / "n1").symlink_to(outside)
    return store, root, outside


def test_delete_through_symlinked_dir_touches_nothing_outside(linked_dir):
    store, _root, outside = linked_dir

    async def go():
        with pytest.raises(StoreError) as ei:
            await store.delete("data/n1/v1/obj")
        assert_symlink_refused(ei, "data/n1/v1/obj")

    run(go)
    assert (outside / "v1" / "obj").read_bytes() == b"outside data"


@pytest.mark.parametrize("mode", ["plain", "if_none_match", "if_match", "multipart"])
def test_put_through_symlinked_dir_writes_nothing_outside(linked_dir, mode):
    store, _root, outside = linked_dir
    before = sorted(p.relative_to(outside) for p in outside.rglob("*"))

    async def go():
        for key in ("data/n1/v1/obj", "data/n1/v2/new"):
            with pytest.raises(StoreError) as ei:
                if mode == "plain":
                    await store.put(key, b"planted")
                elif mode == "if_none_match":
                    await store.put(key, b"planted", if_none_match=True)
                elif mode == "if_match":
                    await store.put(key, b"planted", if_match="whatever")
                else:
                    uid = await store.create_multipart(key)
                    part = await store.upload_part(key, uid, 1, b"planted")
                    await store.complete_multipart(key, uid, [part], crc32c(b"planted"))
            assert_symlink_refused(ei, key)

    run(go)
    assert sorted(p.relative_to(outside) for p in outside.rglob("*")) == before
    assert (outside / "v1" / "obj").read_bytes() == b"outside data"


def test_get_head_list_through_symlinked_dir_read_nothing_outside(linked_dir):
    store, _root, _outside = linked_dir

    async def go():
        await store.put("data/n2/v1/real", b"real")
        for call in (lambda: store.get("data/n1/v1/obj"), lambda: store.get("data/n1/v1/obj", 2),
                     lambda: store.get("data/n1/v1/obj", 1, 3),
                     lambda: store.head("data/n1/v1/obj")):
            with pytest.raises(StoreError) as ei:
                await call()
            assert_symlink_refused(ei, "data/n1/v1/obj")
        for prefix in ("", "data/", "data/n1", "data/n1/", "data/n1/v1/"):
            keys = [i.key for i in await store.list(prefix)]
            assert not any(k.startswith("data/n1") for k in keys), (prefix, keys)
        assert [i.key for i in await store.list("data/")] == ["data/n2/v1/real"]

    run(go)


def test_symlinked_object_file_is_never_followed(env):
    """objects/<key> itself a symlink to a file outside: every operation on the key refuses,
    nothing outside is read, replaced or removed, and a listing does not report it."""
    store, root, outside = env
    victim = outside / "secret"
    victim.write_bytes(b"secret bytes")
    (root / "objects" / "k").mkdir()
    (root / "objects" / "k" / "obj").symlink_to(victim)

    async def go():
        await store.put("k/real", b"real")
        calls = [lambda: store.get("k/obj"), lambda: store.get("k/obj", 1, 2),
                 lambda: store.head("k/obj"), lambda: store.delete("k/obj"),
                 lambda: store.put("k/obj", b"new"),
                 lambda: store.put("k/obj", b"new", if_none_match=True),
                 lambda: store.put("k/obj", b"new", if_match="x")]
        for call in calls:
            with pytest.raises(StoreError) as ei:
                await call()
            assert_symlink_refused(ei, "k/obj")
        assert [i.key for i in await store.list("")] == ["k/real"]

    run(go)
    assert victim.read_bytes() == b"secret bytes"
    assert (root / "objects" / "k" / "obj").is_symlink()


def test_symlinked_objects_root_is_never_followed(env):
    store, root, outside = env
    (outside / "x").write_bytes(b"outside")
    shutil.rmtree(root / "objects")
    (root / "objects").symlink_to(outside)

    async def go():
        for call in (lambda: store.put("x", b"new"), lambda: store.get("x"),
                     lambda: store.head("x"), lambda: store.delete("x")):
            with pytest.raises(StoreError) as ei:
                await call()
            assert_symlink_refused(ei, "x")
        assert await store.list("") == []

    run(go)
    assert sorted(os.listdir(outside)) == ["x"] and (outside / "x").read_bytes() == b"outside"


@pytest.mark.parametrize("level", ["meta", "meta/<h2>"])
def test_symlinked_meta_dir_is_never_followed(env, level):
    """A symlinked meta/ (or meta/<h[:2]>/): a put fails before its object appears, a delete
    fails without removing the sidecar outside, head and list never read a sidecar through
    it (CRC unknown)."""
    store, root, outside = env
    data = b"some data"

    async def go():
        await store.put("obj", data)
        assert (await store.head("obj")).crc32c == crc32c(data)
        link = root / "meta" if level == "meta" else sidecar(root, "obj").parent
        shutil.move(link, outside / "m")
        link.symlink_to(outside / "m")
        outside_sidecars = sorted(p for p in (outside / "m").rglob("*"))
        assert (await store.head("obj")).crc32c is None
        assert [(i.key, i.crc32c) for i in await store.list("")] == [("obj", None)]
        assert await store.get("obj") == data
        with pytest.raises(StoreError) as ei:
            await store.put("obj", b"other")
        assert_symlink_refused(ei, "obj")
        assert await store.get("obj") == data  # failed before the object was replaced
        with pytest.raises(StoreError) as ei:
            await store.delete("obj")
        assert_symlink_refused(ei, "obj")
        assert sorted(p for p in (outside / "m").rglob("*")) == outside_sidecars

    run(go)


def test_symlinked_sidecar_file_is_not_read(env):
    store, root, outside = env

    async def go():
        info = await store.put("obj", b"abc")
        sc = sidecar(root, "obj")
        (outside / "forged.json").write_text(json.dumps({"etag": info.etag, "crc32c": 1234}))
        sc.unlink()
        sc.symlink_to(outside / "forged.json")
        assert (await store.head("obj")).crc32c is None
        assert [i.crc32c for i in await store.list("")] == [None]
        await store.delete("obj")  # removes the link itself, not its target
        assert not sc.is_symlink() and (outside / "forged.json").exists()

    run(go)


def test_symlinked_multipart_dir_is_never_followed(env):
    store, root, outside = env
    shutil.rmtree(root / "multipart")
    (root / "multipart").symlink_to(outside)

    async def go():
        with pytest.raises(StoreError) as ei:
            await store.create_multipart("big")
        assert_symlink_refused(ei, "big")
        assert "at multipart" in str(ei.value)

    run(go)
    assert os.listdir(outside) == []


def test_symlinked_upload_dir_and_part_are_never_followed(env):
    """multipart/<upload_id> replaced by a symlink to a directory outside holding a file `1`:
    upload_part writes nothing there, complete reads nothing from it, abort deletes nothing in
    it. A part file that is a symlink is not read either."""
    store, root, outside = env
    (outside / "1").write_bytes(b"victim part")

    async def go():
        uid = await store.create_multipart("big")
        part = await store.upload_part("big", uid, 1, b"victim part")
        shutil.rmtree(root / "multipart" / uid)
        (root / "multipart" / uid).symlink_to(outside)
        for call in (lambda: store.upload_part("big", uid, 2, b"x"),
                     lambda: store.complete_multipart("big", uid, [part], part.crc32c),
                     lambda: store.abort_multipart("big", uid)):
            with pytest.raises(StoreError) as ei:
                await call()
            assert_symlink_refused(ei, uid)
        with pytest.raises(NotFound):
            await store.head("big")

        # A part that is a symlink to a file outside, of the right size: never read.
        uid2 = await store.create_multipart("big2")
        (root / "multipart" / uid2 / "1").symlink_to(outside / "1")
        with pytest.raises(StoreError) as ei:
            await store.complete_multipart("big2", uid2, [part], part.crc32c)
        assert_symlink_refused(ei, "big2")
        with pytest.raises(NotFound):
            await store.head("big2")
        await store.abort_multipart("big2", uid2)  # removes the link, not its target
        assert not (root / "multipart" / uid2).exists()

    run(go)
    assert sorted(os.listdir(outside)) == ["1"]
    assert (outside / "1").read_bytes() == b"victim part"


def test_symlinked_lock_file_is_never_followed(env):
    store, root, outside = env
    (root / ".lock").symlink_to(outside / "created-through-lock")

    async def go():
        first = await store.put("m", b"v1")
        with pytest.raises(StoreError) as ei:
            await store.put("m", b"v2", if_match=first.etag)
        assert "symlink" in str(ei.value) and not ei.value.transient
        assert await store.get("m") == b"v1"

    run(go)
    assert os.listdir(outside) == []


def test_fifo_is_not_an_object(env):
    """A FIFO planted at a key is no object (head NotFound, not listed); no call blocks on it."""
    store, root, _outside = env
    (root / "objects" / "d").mkdir()
    os.mkfifo(root / "objects" / "d" / "fifo")

    async def go():
        await store.put("d/real", b"r")
        with pytest.raises(NotFound):
            await store.head("d/fifo")
        with pytest.raises(NotFound):
            await store.get("d/fifo")
        assert [i.key for i in await store.list("d/")] == ["d/real"]

    run(go)


# ----------------------------------------------------------------------------------------------
# sidecars


def _shapes(etag: str, crc: int) -> dict[str, bytes]:
    e = json.dumps(etag)
    good = f'{{"etag": {e}, "crc32c": {crc}}}'.encode()
    return {
        "list": b"[]",
        "null": b"null",
        "string": b'"hello"',
        "number": b"42",
        "crc-string": f'{{"etag": {e}, "crc32c": "x"}}'.encode(),
        "crc-negative": f'{{"etag": {e}, "crc32c": -1}}'.encode(),
        "crc-too-big": f'{{"etag": {e}, "crc32c": {1 << 32}}}'.encode(),
        "crc-bool": f'{{"etag": {e}, "crc32c": true}}'.encode(),
        "crc-float": f'{{"etag": {e}, "crc32c": {float(crc)}}}'.encode(),
        "crc-missing": f'{{"etag": {e}}}'.encode(),
        "etag-missing": f'{{"crc32c": {crc}}}'.encode(),
        "etag-int": f'{{"etag": 5, "crc32c": {crc}}}'.encode(),
        "empty": b"",
        "garbage": b"\xff\xfe\x00garbage\x80",
        "deeply-nested": b"[" * 4000,
        "huge": good + b" " * (1 << 20),   # well-formed, but over the 4 KiB cap
        "just-over-cap": good + b" " * (4097 - len(good)),
    }


SHAPES = list(_shapes("e", 1))


@pytest.mark.parametrize("shape", SHAPES)
def test_malformed_sidecar_reads_as_absent(env, shape):
    store, root, _outside = env
    data = os.urandom(1000)

    async def go():
        info = await store.put("dir/obj", data)
        sidecar(root, "dir/obj").write_bytes(_shapes(info.etag, info.crc32c)[shape])
        h = await store.head("dir/obj")
        assert h.crc32c is None and h.size == len(data) and h.etag == info.etag
        assert [(i.key, i.crc32c) for i in await store.list("dir/")] == [("dir/obj", None)]
        assert await store.get("dir/obj") == data
        # The next put replaces the sidecar with a good one.
        info2 = await store.put("dir/obj", data, if_match=info.etag)
        assert (await store.head("dir/obj")).crc32c == crc32c(data) == info2.crc32c
        await store.delete("dir/obj")
        assert not sidecar(root, "dir/obj").exists()

    run(go)


def test_sidecar_at_cap_is_read(env):
    store, root, _outside = env

    async def go():
        info = await store.put("obj", b"abc")
        good = json.dumps({"etag": info.etag, "crc32c": info.crc32c}).encode()
        sidecar(root, "obj").write_bytes(good + b" " * (4096 - len(good)))
        assert (await store.head("obj")).crc32c == crc32c(b"abc")

    run(go)


def test_sidecar_that_is_a_directory_reads_as_absent(env):
    store, root, _outside = env

    async def go():
        await store.put("obj", b"abc")
        sc = sidecar(root, "obj")
        sc.unlink()
        sc.mkdir()
        assert (await store.head("obj")).crc32c is None
        assert await store.get("obj") == b"abc"

    run(go)


def test_sidecar_that_is_a_fifo_reads_as_absent_without_blocking(env):
    """A FIFO as a sidecar must not block the reader. A writer thread feeds it `[]` so that a
    reader that does open it for a blocking read (the old code) gets unblocked and fails, rather
    than hanging the test; with the fix the reader never waits for it."""
    store, root, _outside = env
    sc = sidecar(root, "obj")

    def feed():
        with contextlib.suppress(OSError):
            fd = os.open(sc, os.O_WRONLY)  # waits for a reader
            try:
                os.write(fd, b"[]")
            finally:
                os.close(fd)

    async def go():
        await store.put("obj", b"abc")
        sc.unlink()
        os.mkfifo(sc)
        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        try:
            assert (await store.head("obj")).crc32c is None
        finally:
            # Release the feeder if nobody opened the FIFO for reading long enough.
            while feeder.is_alive():
                rfd = os.open(sc, os.O_RDONLY | os.O_NONBLOCK)
                feeder.join(timeout=0.5)
                os.close(rfd)

    run(go)


# ----------------------------------------------------------------------------------------------
# permissions


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o277], ids=oct)
def test_files_0600_dirs_0700_whatever_the_umask(tmp_path, umask):
    """Every file the store creates (objects, sidecars, parts, the lock file; temp files are
    what objects, sidecars and parts are renamed from) is 0600, every directory 0700."""
    root = tmp_path / "store"
    seen: dict[str, tuple[int, bool]] = {}

    def look(*paths: Path) -> None:
        for p in paths:
            st = p.lstat()
            seen[str(p.relative_to(root))] = (stat.S_IMODE(st.st_mode), stat.S_ISDIR(st.st_mode))

    old = os.umask(umask)
    try:
        store = LocalStore(root)

        async def go():
            first = await store.put("a/b/c", b"x")
            await store.put("a/b/c", b"y", if_match=first.etag)  # creates .lock
            await store.put("a/d", b"z", if_none_match=True)
            uid = await store.create_multipart("a/big")
            await store.upload_part("a/big", uid, 1, b"p1")
            look(root / "multipart" / uid, root / "multipart" / uid / "1")
            await store.abort_multipart("a/big", uid)
            uid = await store.create_multipart("a/big2")
            p = await store.upload_part("a/big2", uid, 1, b"p1")
            await store.complete_multipart("a/big2", uid, [p], p.crc32c)

        run(go)
    finally:
        os.umask(old)
    look(root, *root.rglob("*"))
    assert {".", ".lock", "objects", "meta", "multipart", "objects/a", "objects/a/b",
            "objects/a/b/c", "objects/a/d", "objects/a/big2"} <= set(seen), sorted(seen)
    assert len([k for k in seen if k.startswith("meta/") and k.endswith(".json")]) == 3
    wrong = {k: oct(mode) for k, (mode, is_dir) in seen.items()
             if mode != (0o700 if is_dir else 0o600)}
    assert not wrong, wrong
