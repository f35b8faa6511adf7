"""Takeover (--replicas, docs/ARCHITECTURE.md "Replicas"): a buddy publishes the replica of a
node whose lease expired, as that node would have (`Takeover`), and owns the objects it uploaded
for it until its own namespace does (`TakeoverRecords`).

Why a record: the objects a takeover uploads (`data/<buddy>/takeover/<origin>/<seq>/<i>`) are
in no index row of the buddy's until its namespace sync applies the manifest naming them
(cachemgr.tiering.materialise records them then, and its GC owns them from there). If the path
moves on first (re-committed by another node, or deleted, within one refresh interval), that
manifest is never applied here and nothing would ever delete them. So before its manifest PUT a
takeover writes `<cache>/replicas/.takeovers/<origin>-<seq>.json` ({path, keys}, fsynced); the
holder's drop loop sweeps the records every interval (`sweep`): a record whose keys this node
owns now (its objects table, or a kept set here naming them) is removed; one whose keys the
store's manifest of its path still names waits; one whose keys it no longer names has them
deleted (those another manifest names aside, as of the last listing), then is removed.

State, its owner and its guards: the record files (written by `Takeover.publish` and removed
by `sweep`, both run from the holder's drop loop, one at a time); `taken_over`, the counter.
Crash states: a record without a published manifest (a crash between the record and the PUT)
is swept like a lost race: the store does not name its keys, so they are deleted.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from cachemgr.format import manifest as mf
from cachemgr.format import validate
from cachemgr.format.docs import FileDoc, ManifestDoc
from cachemgr.format.keys import manifest_key
from cachemgr.format.objects import StoredObject
from cachemgr.host.nodefiles import make_dirs, write_durably
from cachemgr.store import NotFound, ObjectStore, StoreError
from cachemgr.tiering.lease import Lease
from cachemgr.tiering.manifests import ManifestWriter

log = logging.getLogger(__name__)

RECORDS = ".takeovers"  # under <cache>/replicas/ (a node id never starts with a dot)

# upload(local path, object key, size): the stored object (cachemgr.transfer.upload)
Upload = Callable[[str, str, int], Awaitable[StoredObject]]
# owned(path, keys): those of `keys` this node's index owns or a kept set here names
Owned = Callable[[str, set[str]], set[str]]


def replica_manifest(desc: dict[str, Any], objects: list[StoredObject]) -> ManifestDoc:
    """The manifest the origin of replica `desc` would have written, its files stored as
    `objects` (Takeover's uploads, or the replica's own chunks: `virtual_objects`)."""
    files: list[FileDoc] = [
        {"path": f["rel"], "size": f["size"], "mode": f["mode"], "mtime_ns": f["mtime_ns"],
         "object": obj.to_json()} for f, obj in zip(desc["files"], objects, strict=True)]
    layout: dict[str, Any] = {"dirs": desc["dirs"], "symlinks": desc["symlinks"]}
    if desc["kind"] == "dir":
        layout["mode"] = desc["mode"]
    if desc["kind"] == "symlink":
        layout["target"] = desc["target"]
    return mf.build(path=desc["path"], kind=desc["kind"], seq=desc["seq"], node=desc["origin"],
                    reason=desc["reason"], committed_ns=desc["committed_ns"], layout=layout,
                    files=files)


class Takeover:
    """A buddy publishes the replica of a node whose lease expired, as that node would have:
    its files uploaded under `data/<this node>/takeover/<origin>/<seq>/<i>`, then the manifest
    the origin would have written (its path, kind, commit time, seq and node id; `commit.nodes`
    names both writers, `commit.taken_over_by` this node), written by the one manifest writer
    (cachemgr.tiering.manifests) with the origin's place in the order of the path's commits:
    a later commit of the path, by anyone, wins (the replica is dropped); the same commit (the
    origin came back, or another of its buddies, racing this one, published it first) counts
    as done, and this node deletes the objects it uploaded for it (`_discard`: the manifest
    there names the winner's); an earlier one is replaced. Once: the replica is dropped after
    its publication; the drop loop, the only caller, runs one replica at a time. Counted
    (`taken_over`) and logged by the buddy whose PUT published the set only."""

    def __init__(self, *, store: ObjectStore, node: str, lease: Lease,
                 live: Callable[[], Awaitable[dict[str, float]]], upload: Upload,
                 records: TakeoverRecords) -> None:
        self.store, self.node, self.lease, self.live = store, node, lease, live
        self._upload = upload
        self.records = records
        self._writer = ManifestWriter(store, lease.ensure)  # the fence before every PUT
        self.taken_over = 0

    async def publish(self, desc: dict[str, Any], where: Path) -> bool:
        """True once the store holds this commit (or a newer one) of the replica's path."""
        await self.lease.ensure()  # the fence: no write under a lease this node lost
        objects = []
        for i, f in enumerate(desc["files"]):
            key = f"data/{self.node}/takeover/{desc['origin']}/{desc['seq']}/{i}"
            objects.append(await self._upload(str(where / str(i)), key, f["size"]))
        m = replica_manifest(desc, objects)
        files = m["files"]
        m["commit"]["nodes"] = sorted({desc["origin"], self.node})
        m["commit"]["taken_over_by"] = self.node
        record = await trio.to_thread.run_sync(
            self.records.write, desc, [f["object"]["key"] for f in files])
        there = await self._put(desc, m)
        if there is None:
            self.taken_over += 1
            log.warning("replicas: took over set %d of node %s (%s): its lease expired before "
                        "the store held it; published it from this node's replica (%d files, "
                        "%d bytes)", desc["seq"], desc["origin"], desc["path"], len(files),
                        m["total_bytes"])
        elif await self._discard(desc, [f["object"]["key"] for f in files], there):
            await trio.to_thread.run_sync(self.records.remove, record)
        return True

    async def _discard(self, desc: dict[str, Any], uploaded: list[str],
                       there: ManifestDoc) -> bool:
        """Another writer published this commit (or a newer one) first: another buddy of the
        origin racing this one, or the origin back. The objects this takeover uploaded that the
        manifest there does not name are nobody's (no manifest, no index row here): delete
        them. One it names is this node's own, from an earlier PUT of the same set whose reply
        was lost, and stays. A delete that fails is logged and left (`ckptfs fsck` reports
        it as garbage; the record stays, so the next sweep tries again): the replica is dropped all
        the same, the set being in the store. True once every such object is gone."""
        named = {f["object"]["key"] for f in there.get("files", [])}
        mine = [k for k in uploaded if k not in named]
        for key in mine:
            try:
                await self.store.delete(key)
            except StoreError as e:
                log.warning("replicas: cannot delete %s, uploaded to take over set %d of node"
                            " %s (%s) that another node published first: %s", key, desc["seq"],
                            desc["origin"], desc["path"], e)
                return False
        if mine:  # the writers there but the origin: the buddy that won (none: the origin)
            by = [n for n in there.get("commit", {}).get("nodes", []) if n != desc["origin"]]
            log.info("replicas: set %d of node %s (%s) was published by %s first: deleted the"
                     " %d objects this node uploaded for it", desc["seq"], desc["origin"],
                     desc["path"], ", ".join(by) or "its origin", len(mine))
        return True

    async def _put(self, desc: dict[str, Any], m: ManifestDoc) -> ManifestDoc | None:
        """None once published, or the manifest there: this commit, or a later one in the one
        order of a path's commits (cachemgr.tiering.manifests; it carries the origin's commit,
        so it wins or loses where the origin's own PUT would). What is there is looked at
        first: a buddy knows nothing of the path but the replica."""
        done = await self._writer.write(m, mf.dumps(m))
        return done.there if done.outcome != "written" else None


class TakeoverRecords:
    """The takeover records of one cache (see the module docstring); blocking file I/O, called
    in worker threads."""

    def __init__(self, replicas_dir: Path) -> None:
        self.dir = replicas_dir / RECORDS

    def write(self, desc: dict[str, Any], keys: list[str]) -> Path:
        make_dirs(self.dir)
        where = self.dir / f"{desc['origin']}-{desc['seq']}.json"
        write_durably(where, json.dumps({"path": desc["path"], "keys": keys}).encode())
        return where

    def read(self) -> list[tuple[Path, str, set[str]]]:
        """(file, path, keys) of each record; an unreadable one is logged and removed (its
        objects are then left to `ckptfs fsck`)."""
        out = []
        for p in sorted(self.dir.glob("*.json")) if self.dir.is_dir() else []:
            try:
                doc = json.loads(p.read_bytes())
                path = validate.path(doc["path"], 2, "takeover record path")
                keys = {k for k in doc["keys"] if isinstance(k, str)}
            except (OSError, ValueError, KeyError, TypeError, validate.DocumentError) as e:
                log.warning("replicas: takeover record %s unreadable (%s); removed, its objects"
                            " are left to ckptfs fsck", p, e)
                p.unlink(missing_ok=True)
                continue
            out.append((p, path, keys))
        return out

    def remove(self, where: Path) -> None:
        """Remove record `where`, and the records' directory once it is empty (the drop loop
        writes and removes records one at a time: no write races this)."""
        where.unlink(missing_ok=True)
        try:
            self.dir.rmdir()
        except OSError:
            pass  # other records remain (ENOTEMPTY), or it is gone already


async def sweep(records: TakeoverRecords, store: ObjectStore, owned: Owned) -> None:
    """One pass over the takeover records (module docstring). StoreError: the store cannot say
    now (retried at the next pass)."""
    for where, path, keys in await trio.to_thread.run_sync(records.read):
        if owned(path, keys) == keys:  # this node's namespace has them: its GC's from here on
            await trio.to_thread.run_sync(records.remove, where)
            continue
        try:
            named = {f["object"]["key"] for f in
                     validate.manifest(await store.get(manifest_key(path)))["files"]}
        except NotFound:
            named = set()
        except validate.DocumentError:
            continue  # not a document to judge by: left as it is (fsck judges the objects)
        if keys & named:
            continue  # the store names them: this node's next listing applies that manifest
        gone = sorted(keys - owned(path, keys))
        for key in gone:
            await store.delete(key)
        await trio.to_thread.run_sync(records.remove, where)
        if gone:
            log.info("replicas: the set taken over at %s moved on before this node applied it:"
                     " deleted the %d objects uploaded for it", path, len(gone))
