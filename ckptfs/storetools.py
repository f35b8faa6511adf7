"""`ckptfs ls`, `ckptfs restore`, `ckptfs fsck`: tools that work on a store, without a mount.

For people who restore, audit and clean up. STORE is a store URL as `ckptfs mount --store`
takes it, with the same S3 options, and the store is built as the mount builds it
(cachemgr.store.open_store wrapped in a RetryingStore), so the same credentials, endpoints and
retries apply. Everything read from the store passes cachemgr.format.validate (through
cachemgr.format.storeread, the reader shared with scripts/ckpt_restore.py) before use, every
object is decoded and checked by cachemgr.format.decode (the decoder the mount uses too), and
no document is read past validate.MAX_DOCUMENT_BYTES.

Threads: the async store runs in a trio loop on a thread of its own, and the tools read it
through its blocking face (cachemgr.format.storeview: `StoreLoop`, `ObjectStoreView`): the
caller's thread keeps Ctrl-C and the progress display, and cachemgr.format.resumable's worker
threads read objects in parallel.
State: a `Session` owns its `StoreLoop` (the loop thread) and the store view over it; an `_Fsck`
run's findings (`named`, `protected`, `damage`, counts) are filled by the document reader
threads under `_Fsck.lock`, and read by the calling thread only after they have all finished.

Exit codes (README "Exit codes"): 0 done; 1 unexpected error or interrupted; 2 bad command
line; 7 the store is unusable (unreachable, no such bucket, access denied, a listing or read
that keeps failing); 8 `restore`: no such set (`ls PATH`: nothing at PATH); 10 damage in the
store: a manifest that fails validation, or an object a manifest names that is missing, of the
wrong size or fails its CRC32C (`fsck`; `restore` of such a set); 11 `restore`: the
destination refused (an unrelated file in the way without --overwrite, a symlink or a file
where a directory must be, not writable). One line `ckptfs: <reason>` on stderr for each
failure, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import sys
import threading
import time
from typing import Any, Self, cast

from cachemgr.format import keys, names, readerrors, resumable, storeread, validate
from cachemgr.format.docs import ObjectDoc
from cachemgr.format.storeview import ObjectStoreView, StoreLoop
from cachemgr.store.base import PROBE_PREFIX
from cachemgr.tiering import lease as lease_record
from cachemgr.tiering import members as mem
from cachemgr.tiering import parts as prt

from .config import s3_from_env
from .fmt import human
from .mount import EXIT_ERROR, EXIT_NO_SET, EXIT_OK, EXIT_STORE, EXIT_USAGE

EXIT_DAMAGE = 10   # the store holds damage: an invalid manifest, an object missing/wrong/bad CRC
EXIT_DEST = 11     # restore: the destination refused (an unrelated file in the way, ...)

# Manifest bytes held at once while reading many (each at most MAX_DOCUMENT_BYTES): what bounds
# the memory of `ls` and `fsck`, whatever the store holds (as cachemgr.tiering.remote's
# _HOLD_BYTES).
_HOLD_BYTES = validate.MAX_DOCUMENT_BYTES
_DOC_READERS = 8          # documents read at once
_DELETE_BATCH = 500       # garbage deleted between two re-listings of manifests/

class ToolError(Exception):
    def __init__(self, code: int, msg: str) -> None:
        super().__init__(msg)
        self.code = code


def _code(e: readerrors.RestoreError) -> int:
    if isinstance(e, readerrors.NoSuchSet):
        return EXIT_NO_SET
    if isinstance(e, readerrors.UsageError):
        return EXIT_USAGE
    if isinstance(e, readerrors.DestinationError):
        return EXIT_DEST
    if isinstance(e, readerrors.StoreError):
        return EXIT_STORE
    return EXIT_DAMAGE  # CorruptError: invalid or damaged data in the store


def _fail(code: int, msg: str) -> int:
    print(f"ckptfs: {' '.join(msg.splitlines())}", file=sys.stderr)
    return code


# -- the command line ----------------------------------------------------------------------------

def run(a: argparse.Namespace) -> int:
    """Run `ls`, `restore` or `fsck`: the exit code (README "Exit codes")."""
    if getattr(a, "parallel", None) is None:
        a.parallel = resumable.DEFAULT_WORKERS
    cmd = {"ls": cmd_ls, "restore": cmd_restore, "fsck": cmd_fsck}[a.cmd]
    # The store layer logs its retries; these tools report in one line each, so no log line
    # may reach stderr through logging's last-resort handler.
    if not logging.getLogger().handlers:
        logging.getLogger().addHandler(logging.NullHandler())
    try:
        return cmd(a)
    except ToolError as e:
        return _fail(e.code, str(e))
    except readerrors.RestoreError as e:
        return _fail(_code(e), str(e))


# -- the store, as the mount builds it -----------------------------------------------------------

class Session:
    """An open store: `view`, and the listing of manifests/ the probe made."""

    def __init__(self, a: argparse.Namespace, workers: int = resumable.DEFAULT_WORKERS) -> None:
        from cachemgr.store import RetryingStore, RetryPolicy, open_store
        from cachemgr.store import StoreError as Unusable

        url = a.store
        if url.startswith("file://"):
            root = url[len("file://"):]
            if not root.startswith("/"):
                raise ToolError(EXIT_USAGE, f"a file:// store needs an absolute path: {url!r}")
            # LocalStore would create a missing store: these tools only read existing ones.
            if not os.path.isdir(os.path.join(root, "objects")):
                raise ToolError(EXIT_STORE, f"object store {url} is unusable: no store there "
                                "(no objects/ directory)")
        elif url.startswith("s3://"):
            if not url[len("s3://"):].partition("/")[0]:
                raise ToolError(EXIT_USAGE, f"{url!r}: no bucket")
        else:
            raise ToolError(EXIT_USAGE, f"unsupported store URL {url!r} (s3://bucket[/prefix] "
                            "or file:///dir)")
        self.url = url
        endpoint, region = s3_from_env(a.s3_endpoint, a.s3_region)  # flag > AWS_* > config
        try:
            inner = open_store(url, endpoint_url=endpoint, region=region,
                               path_style=a.s3_path_style, profile=a.s3_profile,
                               max_connections=max(16, workers)) \
                if url.startswith("s3://") else open_store(url)
        except Exception as e:  # noqa: BLE001 - StoreError; botocore: an unknown profile, a config
            what = str(e) if isinstance(e, Unusable) else f"{type(e).__name__}: {e}"
            raise ToolError(EXIT_STORE, f"object store {url} is unusable: {what}") from None
        self.store = RetryingStore(inner)
        self.loop = StoreLoop()
        self.view = ObjectStoreView(self.loop, self.store, url)
        # The probe (as at mount): the first listing, with fewer retries, so that a store that
        # cannot work at all (unreachable, no such bucket, access denied) fails within seconds.
        probe = ObjectStoreView(self.loop, RetryingStore(inner, RetryPolicy(attempts=3,
                                                                            max_delay=1.0)), url)
        try:
            self.manifest_infos = probe.infos(keys.MANIFEST_PREFIX)
        except readerrors.StoreError as e:
            self.close()
            raise ToolError(EXIT_STORE, f"{e} (the store is unusable)") from None

    def close(self) -> None:
        with contextlib.suppress(Exception):  # closing: nothing left to report
            self.loop.call(self.store.aclose)
        self.loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- helpers ------------------------------------------------------------------------------------

def _age(s: float) -> str:
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    if s < 2 * 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} d"


def _when(ns: int) -> str:
    return datetime.datetime.fromtimestamp(ns / 1e9, tz=datetime.UTC).strftime(
        "%Y-%m-%d %H:%M:%S")


class _Budget:
    """Bytes of documents held at once (a counting semaphore by size)."""

    def __init__(self, total: int) -> None:
        self.total, self.free = total, total
        self.cv = threading.Condition()

    def take(self, n: int) -> int:
        n = max(1, min(n, self.total))
        with self.cv:
            self.cv.wait_for(lambda: self.free >= n)
            self.free -= n
        return n

    def give(self, n: int) -> None:
        with self.cv:
            self.free += n
            self.cv.notify_all()


def _read_docs(view: ObjectStoreView, infos: list, fn) -> None:
    """fn(info, raw bytes or None if gone) for each listed document, _DOC_READERS at a time and
    at most _HOLD_BYTES of them held at once; a document bigger than MAX_DOCUMENT_BYTES is not
    read (fn gets b"" and checks the listed size itself)."""
    budget = _Budget(_HOLD_BYTES)

    def one(info) -> None:
        if info.size > validate.MAX_DOCUMENT_BYTES:
            fn(info, b"")
            return
        n = budget.take(info.size)
        try:
            raw = view.get(info.key, max_bytes=validate.MAX_DOCUMENT_BYTES)
            fn(info, raw)
        finally:
            budget.give(n)

    resumable.run_parallel(infos, one, _DOC_READERS, threading.Event(), lambda: None)


def _load(info, raw: bytes | None) -> storeread.Manifest | None:
    """The validated manifest listed as `info` whose bytes are `raw`; None if it is gone;
    CorruptError if it is invalid or too big."""
    if raw is None:
        return None
    if info.size > validate.MAX_DOCUMENT_BYTES or len(raw) > validate.MAX_DOCUMENT_BYTES:
        raise readerrors.CorruptError(f"{info.key}: a manifest of {info.size} bytes (at most "
                                     f"{validate.MAX_DOCUMENT_BYTES})")
    return storeread.parse_manifest(raw, info.key)


def _path_forms(p: str) -> list[str]:
    """The escaped forms PATH may stand for (as given, if it is one; and its bytes escaped)."""
    p = p.strip("/")
    forms = [p] if names.is_canonical_path(p) else []
    forms.append(names.escape_path(os.fsencode(p)))
    out = []
    for f in dict.fromkeys(forms):
        try:
            validate.path(f, 2, "path", validate.ManifestError)
        except validate.ManifestError:
            continue
        out.append(f)
    if not out:
        raise ToolError(EXIT_USAGE, f"{p!r} is not a path of the mount")
    return out


def _under(path: str, forms: list[str] | None) -> bool:
    return forms is None or any(path == f or path.startswith(f + "/") for f in forms)


class _Progress:
    """Restore progress on stderr: a rich progress bar on a terminal, else a plain line every
    10 seconds."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.tty = sys.stderr.isatty()
        self.bar: Any = None   # rich.progress.Progress on a terminal
        self.task: Any = None  # its TaskID
        self.t0 = self.last = time.monotonic()
        if self.tty:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                TransferSpeedColumn(), TimeRemainingColumn(),
                                TextColumn("{task.fields[files]}"),
                                console=Console(stderr=True), transient=False)
            self.bar.start()
            self.task = self.bar.add_task(label, total=None, files="")

    def update(self, s: resumable.RestoreProgress) -> None:
        files = f"{s['files_done']}/{s['files_total']} files"
        if self.bar is not None:
            self.bar.update(self.task, total=s["bytes_total"], completed=s["bytes_done"],
                            files=files)
            return
        now = time.monotonic()
        if now - self.last >= 10 and s["bytes_done"] < s["bytes_total"]:
            self.last = now
            pct = s["bytes_done"] / s["bytes_total"] if s["bytes_total"] else 1.0
            rate = s["bytes_fetched"] / max(now - self.t0, 1e-3)
            print(f"ckptfs: {self.label} {pct:4.0%}: {human(s['bytes_done'])} of "
                  f"{human(s['bytes_total'])}, {files}, {human(rate)}/s", file=sys.stderr,
                  flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


# -- ls -----------------------------------------------------------------------------------------

def _summary(m: storeread.Manifest, key: str) -> dict:
    raw = m["total_bytes"]
    stored = sum(f["object"]["stored_size"] for f in m["files"])
    c = m["commit"]
    out = {"path": m["path"], "kind": m["kind"], "files": len(m["files"]), "bytes": raw,
           "stored_bytes": stored, "ratio": round(stored / raw, 4) if raw else None,
           "node": c["node"], "nodes": c.get("nodes", [c["node"]]), "seq": c["seq"],
           "reason": c["reason"], "committed_ns": c["committed_ns"],
           "committed": _when(c["committed_ns"]), "key": key}
    if "published_ns" in c:
        out["published_ns"] = c["published_ns"]
    if m["kind"] == "symlink":
        out["target"] = m["target"]
    return out


def cmd_ls(a: argparse.Namespace) -> int:
    forms = _path_forms(a.path) if a.path else None
    with Session(a) as s:
        rows: list[dict] = []
        bad: list[dict] = []
        lock = threading.Lock()

        def wanted(info) -> bool:
            if not keys.is_manifest_key(info.key):
                return False
            p = keys.path_of_manifest_key(info.key)
            return p is None or _under(p, forms)  # a hashed key: only its document tells

        def one(info, raw) -> None:
            try:
                m = _load(info, raw)
            except readerrors.CorruptError as e:
                p = keys.path_of_manifest_key(info.key)
                if forms is None or (p is not None and _under(p, forms)):
                    with lock:
                        bad.append({"key": info.key, "path": p, "reason": str(e)})
                return
            if m is not None and _under(m["path"], forms):
                with lock:
                    rows.append(_summary(m, info.key))

        _read_docs(s.view, [i for i in s.manifest_infos if wanted(i)], one)
    rows.sort(key=lambda r: r["path"])
    bad.sort(key=lambda r: r["key"])
    if a.json:
        print(json.dumps({"store": a.store, "sets": rows, "invalid": bad}, indent=2))
    else:
        if rows:
            w = max(len("SET"), *(len(r["path"]) for r in rows))
            print(f"{'SET':<{w}}  {'KIND':<7} {'FILES':>6} {'SIZE':>10} {'STORED':>10} "
                  f"{'RATIO':>6}  {'COMMITTED (UTC)':<19}  NODE")
            for r in rows:
                ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
                others = len(r["nodes"]) - 1
                node = r["node"] + (f" (+{others} nodes)" if others else "")
                print(f"{r['path']:<{w}}  {r['kind']:<7} {r['files']:>6} "
                      f"{human(r['bytes']):>10} {human(r['stored_bytes']):>10} {ratio:>6}  "
                      f"{r['committed']:<19}  {node}")
        for b in bad:
            print(f"INVALID  {b['reason']}")
    if a.path and not rows and not bad:
        return _fail(EXIT_NO_SET, f"no set at or under {a.path!r} in {a.store}")
    return EXIT_OK


# -- restore ------------------------------------------------------------------------------------

def cmd_restore(a: argparse.Namespace) -> int:
    with Session(a, a.parallel) as s:
        m = storeread.find_set(s.view, a.set)
        bar = _Progress(f"restore {m['path']}")
        try:
            r = resumable.restore_resumable(s.view, m, a.dest, overwrite=a.overwrite,
                                            workers=a.parallel, progress=bar.update)
        except KeyboardInterrupt:
            bar.close()
            return _fail(EXIT_ERROR, f"interrupted: rerun the same command to resume the "
                         f"restore of {m['path']}")
        finally:
            bar.close()
    already = r["bytes_done"] - r["bytes_fetched"]
    print(f"ckptfs: restored {m['path']} to {os.fsdecode(r['target'])!r}: {r['files_total']} "
          f"file(s), {human(r['bytes_total'])} ({human(r['bytes_fetched'])} fetched, "
          f"{human(already)} already there and verified) in {r['seconds']:.1f}s, every "
          "CRC32C checked")
    return EXIT_OK


# -- fsck ---------------------------------------------------------------------------------------

def _loose_keys(raw: bytes | None) -> set[str] | None:
    """Every string that looks like an object key (`data/...`) anywhere in a document that
    failed validation (its objects must not become garbage: a newer format, a clock ahead), or
    None if it is not even JSON (then its objects cannot be known)."""
    if not raw:
        return None
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    out: set[str] = set()
    stack = [doc]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
        elif isinstance(x, str) and x.startswith("data/"):
            out.add(x)
    return out


def _node_of_data(key: str) -> str | None:
    parts = key.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "data" else None


def _record_node(key: str) -> tuple[str, str] | None:
    """(kind, the node whose liveness decides) of a protocol record key, or None."""
    if key.startswith(prt.PREFIX):
        p = prt.parse_key(key)
        return ("part record", p[1]) if p else None
    n = mem.parse_member_key(key)
    if n is not None:
        return "member record", n
    iid = mem.parse_intent_key(key)
    if iid is not None:
        return "intent", iid.split("-")[0]
    ack = mem.parse_ack_key(key)
    if ack is not None:
        return "ack", ack[0].split("-")[0]  # the committer's: it deletes its acks itself
    return None


class _Fsck:
    def __init__(self, s: Session, a: argparse.Namespace) -> None:
        self.s, self.a, self.view = s, a, s.view
        self.older = a.older_than
        self.now = time.time()
        self.lock = threading.Lock()
        self.damage: list[str] = []
        self.invalid = 0
        self.manifests = 0
        self.named: dict[str, tuple[ObjectDoc, str]] = {}   # object key -> (object, manifest key)
        self.protected: set[str] = set()               # keys named loosely (invalid documents)
        self.protected_nodes: set[str] = set()         # nodes with a record that did not parse
        self.unknown: list[str] = []                   # documents whose objects are unknown
        self.seen_manifests: dict[str, str] = {}       # manifest key -> etag read

    def out(self, line: str) -> None:
        print(line, flush=True)

    def add_manifest(self, info, raw) -> None:
        try:
            m = _load(info, raw)
        except readerrors.CorruptError as e:
            loose = _loose_keys(raw)
            with self.lock:
                self.manifests += 1
                self.invalid += 1
                self.damage.append(f"DAMAGED {e}")
                self.seen_manifests[info.key] = info.etag
                if loose is None:
                    self.unknown.append(info.key)
                else:
                    self.protected |= loose
            return
        with self.lock:
            self.seen_manifests[info.key] = info.etag
            if m is None:
                return
            self.manifests += 1
            for f in m["files"]:
                self.named.setdefault(f["object"]["key"], (f["object"], info.key))

    def still_named(self, key: str, mkey: str) -> bool:
        """Whether manifest `mkey` (read again now) still names object `key`: a set replaced or
        deleted since it was read takes its objects with it, which is no damage."""
        try:
            m = storeread.load_manifest(self.view, mkey)
        except readerrors.CorruptError:
            return True
        return m is not None and any(f["object"]["key"] == key for f in m["files"])

    def check_objects(self, data: dict) -> tuple[int, int, int]:
        present = missing = wrong = 0
        for key, (obj, mkey) in sorted(self.named.items()):
            info = data.get(key)
            if info is None:
                info = self.view.head(key)  # the listing may predate its upload
            if info is None:
                if self.still_named(key, mkey):
                    missing += 1
                    self.damage.append(f"DAMAGED {key}: missing (named by {mkey})")
                continue
            if info.size != obj["stored_size"]:
                wrong += 1
                self.damage.append(f"DAMAGED {key}: {info.size} bytes in the store, the "
                                   f"manifest says {obj['stored_size']} (named by {mkey})")
                continue
            present += 1
            data[key] = info
        return present, missing, wrong

    def verify(self, data: dict) -> int:
        todo = [(k, o, mk) for k, (o, mk) in sorted(self.named.items()) if
                k in data and data[k].size == o["stored_size"]]
        total = sum(o["size"] for _, o, _ in todo)
        bar = _Progress("verify") if todo else None
        snap: resumable.RestoreProgress = {
            "bytes_total": total, "bytes_done": 0, "bytes_fetched": 0,
            "files_total": len(todo), "files_done": 0}

        def one(item) -> None:
            _key, obj, mkey = item
            try:
                storeread.verify_object(self.view, obj)
            except readerrors.CorruptError as e:
                with self.lock:
                    self.damage.append(f"DAMAGED {e} (named by {mkey})")
            with self.lock:
                snap["bytes_done"] += obj["size"]
                snap["bytes_fetched"] += obj["stored_size"]
                snap["files_done"] += 1

        def tick() -> None:
            if bar is not None:
                with self.lock:
                    bar.update(snap.copy())

        try:
            resumable.run_parallel(todo, one, self.a.parallel, threading.Event(), tick)
        finally:
            if bar is not None:
                bar.close()
        return len(todo)

    def _lease_runs(self, info) -> bool:
        """Whether the member record `info` is within the lease it states (cachemgr.tiering.members:
        the same test committers use to wait for a node)."""
        try:
            raw = self.view.get(info.key, validate.MAX_PROTOCOL_BYTES)
            lease = validate.protocol_doc(raw, "member")["lease_s"] if raw else 0.0
        except (validate.DocumentError, readerrors.CorruptError):
            return False  # not a member record ckptfs can read: liveness by age only
        return self.now - info.mtime <= lease + lease_record.LEASE_SKEW_S

    def garbage(self, data: dict) -> tuple[list, int, dict]:
        """(garbage [(key, size, kind, why)], unreferenced objects kept, live nodes)."""
        member_infos = self.view.infos(lease_record.MEMBERS)
        live: dict[str, float] = {}
        for i in member_infos:
            n = mem.parse_member_key(i.key)
            # Live: renewed within --older-than, or within its own lease (a mounted node renews
            # every lease/4: its records are never garbage, whatever --older-than says).
            if n is not None and (self.now - i.mtime < self.older or self._lease_runs(i)):
                live[n] = max(live.get(n, 0.0), i.mtime)
        out = []
        records = [i for p in (prt.PREFIX, mem.INTENTS, mem.ACKS) for i in self.view.infos(p)]
        kept_parts = []
        for i in member_infos + records:
            rn = _record_node(i.key)
            if rn is None:
                continue  # not a key ckptfs writes: left alone
            kind, node = rn
            age = self.now - i.mtime
            if age >= self.older and node not in live:
                why = f"{kind} of node {node}, {_age(age)} old, not seen for {_age(self.older)}"
                out.append((i.key, i.size, kind, why))
            elif kind == "part record":
                kept_parts.append(i)

        # Scratch objects of a mount's conditional-write probe (docs/STORES.md), deleted by
        # the probe itself; one older than the limit was left by a crash in the middle of it.
        for i in self.view.infos(PROBE_PREFIX):
            age = self.now - i.mtime
            if age >= self.older:
                why = (f"conditional-write probe object, {_age(age)} old (a mount stopped in"
                       " the middle of its probe)")
                out.append((i.key, i.size, "probe object", why))

        def part(info, raw) -> None:  # a kept record's objects are not garbage
            node = cast(tuple[str, str], _record_node(info.key))[1]  # a kept part record
            try:
                if not raw:
                    raise validate.PartError("too big or gone")
                rec = validate.part_record(raw, info.key)
            except validate.PartError:
                loose = _loose_keys(raw)
                with self.lock:
                    if loose is None:
                        self.protected_nodes.add(node)
                    else:
                        self.protected |= loose
                return
            with self.lock:
                self.protected |= {f["object"]["key"] for f in rec["files"] if f["object"]}

        _read_docs(self.view, kept_parts, part)
        kept = 0
        for key, info in sorted(data.items()):
            if key in self.named or key in self.protected:
                continue
            dnode = _node_of_data(key)
            age = self.now - info.mtime
            if age < self.older or dnode in live or dnode in self.protected_nodes:
                kept += 1
                continue
            out.append((key, info.size, "data object",
                        f"data object, {_age(age)} old: no manifest names it"
                        + (f"; node {dnode} not seen for {_age(self.older)}" if dnode else "")))
        return out, kept, live

    def protect(self, info, raw) -> None:
        """A manifest that appeared or changed after the check: its objects are not garbage
        (whatever it is: it was not part of the check)."""
        try:
            m = _load(info, raw)
        except readerrors.CorruptError:
            loose = _loose_keys(raw)
            with self.lock:
                self.seen_manifests[info.key] = info.etag
                if loose is None:
                    self.unknown.append(info.key)
                else:
                    self.protected |= loose
            return
        with self.lock:
            self.seen_manifests[info.key] = info.etag
            if m is not None:
                self.protected |= {f["object"]["key"] for f in m["files"]}

    def recheck_manifests(self) -> None:
        """Read every manifest that appeared or changed since it was read (a set published
        meanwhile): its objects are protected."""
        infos = [i for i in self.view.infos(keys.MANIFEST_PREFIX) if keys.is_manifest_key(i.key)
                 and self.seen_manifests.get(i.key) != i.etag]
        if infos:
            _read_docs(self.view, infos, self.protect)

    def repair(self, garbage: list) -> tuple[int, int, list[str]]:
        deleted = freed = 0
        errors: list[str] = []
        for b in range(0, len(garbage), _DELETE_BATCH):
            self.recheck_manifests()
            for key, size, kind, _why in garbage[b:b + _DELETE_BATCH]:
                if kind == "data object" and (self.unknown or key in self.named or
                                              key in self.protected):
                    self.out(f"KEPT    {key}: " + ("named by a manifest now"
                             if not self.unknown else "a manifest could not be read"))
                    continue
                try:
                    info = self.view.head(key)
                    if info is None:
                        continue  # gone already (its node, or another fsck)
                    if self.now - info.mtime < self.older:
                        self.out(f"KEPT    {key}: rewritten since it was listed")
                        continue
                    self.view.delete(key)
                except readerrors.StoreError as e:
                    errors.append(str(e))
                    self.out(f"FAILED  {key}: {e}")
                    continue
                deleted += 1
                freed += size
                self.out(f"DELETED {key}")
        return deleted, freed, errors


def cmd_fsck(a: argparse.Namespace) -> int:
    with Session(a, a.parallel) as s:
        f = _Fsck(s, a)
        _read_docs(s.view, [i for i in s.manifest_infos if keys.is_manifest_key(i.key)],
                   f.add_manifest)
        # Listed after the manifests were read: an object a manifest names was uploaded before
        # that manifest was written, so it is in this listing unless it went since.
        data = {i.key: i for i in s.view.infos("data/")}
        listed = len(data)
        present, missing, wrong = f.check_objects(data)
        verified = f.verify(data) if a.verify else 0
        garbage, kept, live = f.garbage(data)
        for line in sorted(f.damage):
            f.out(line)
        for key, size, _kind, why in garbage:
            f.out(f"GARBAGE {key} ({human(size)}): {why}")
        deleted = freed = 0
        errors: list[str] = []
        if a.repair and garbage:
            deleted, freed, errors = f.repair(garbage)
    gbytes = sum(g[1] for g in garbage)
    by_kind: dict[str, int] = {}
    for g in garbage:
        by_kind[g[2]] = by_kind.get(g[2], 0) + 1
    print(f"fsck {a.store}: {f.manifests} manifests ({f.invalid} invalid), {len(f.named)} "
          f"objects named: {present} present, {missing} missing, {wrong} of the wrong size"
          + (f", {verified} read and CRC32C-checked" if a.verify else "")
          + f"; {listed} objects under data/; {len(f.damage)} problems")
    kinds = ", ".join(f"{n} {k}s" for k, n in sorted(by_kind.items())) or "none"
    print(f"garbage: {kinds} ({human(gbytes)}), older than {_age(a.older_than)} and of nodes "
          f"not seen for as long; {kept} unreferenced objects kept (younger, or of "
          f"{len(live)} live nodes)")
    if f.unknown and any(g[2] == "data object" for g in garbage):
        print(f"note: {len(f.unknown)} manifest(s) could not be read at all (e.g. "
              f"{f.unknown[0]}): data objects are not deleted while they are there")
    if a.repair:
        print(f"repair: deleted {deleted} ({human(freed)})"
              + (f", {len(errors)} deletions failed" if errors else ""))
    elif garbage:
        print("not repaired: rerun with --repair to delete the garbage")
    if f.damage:
        return EXIT_DAMAGE
    if errors:
        return _fail(EXIT_STORE, f"{len(errors)} deletions failed: {errors[0]}")
    return EXIT_OK
