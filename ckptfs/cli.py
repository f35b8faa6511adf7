"""The `ckptfs` command line. Builds a frozen `MountConfig` and hands it to `ckptfs.mount`.

Every failure prints one line, `ckptfs: <reason>`, on stderr and exits with a documented code
(README "Exit codes", constants in `ckptfs.mount`). Tracebacks never reach the user.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import NoReturn

from . import __version__, api, cliref, setupnative, storeargs
from .config import (
    LOG_LEVELS,
    PREFETCH_MODES,
    ConfigError,
    MountConfig,
    default_cache_dir,
    parse_size,
    s3_from_env,
)
from .csi import cli as csi_cli
from .daemon import run_daemon
from .mount import (
    EXIT_ERROR,
    EXIT_MOUNTPOINT,
    EXIT_OK,
    EXIT_STORE,
    EXIT_UNSAVED,
    EXIT_USAGE,
    MountError,
    check_cache_dir,
    check_fuse,
    check_mountpoint,
    check_overlap,
    check_runtime_dir,
    find_mount,
    setup_logging,
    start,
    umount,
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, documented code, no usage dump
        print(f"ckptfs: {message} (see ckptfs {self.prog.split()[-1]} --help)"
              if " " in self.prog else f"ckptfs: {message} (see ckptfs --help)", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _nonneg_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {s!r}") from None
    # float() accepts 'nan', 'inf' and '1e400' (= inf); none of them is a usable number of
    # seconds (nan compares false with every bound, so it would slip through range checks).
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"not a finite number: {s!r}")
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {s}")
    return v


def _size(s: str) -> int:
    """A size option ('64M'); argparse names the option in the one-line error."""
    try:
        return parse_size(s)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


WATCH_DEFAULT = 2.0  # `status --watch`: seconds between pages


def _interval(s: str) -> float:
    v = _nonneg_float(s)
    # faster than 10 pages a second nobody reads, and each page costs the daemon a status
    if v < 0.1:
        raise argparse.ArgumentTypeError(f"must be >= 0.1: {s}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="ckptfs", description="FUSE checkpoint filesystem for ML training.")
    p.add_argument("--version", action="version", version=f"ckptfs {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    _add_mount(sub)
    _add_umount(sub)
    _add_commit(sub)
    _add_prefetch(sub)
    _add_wait(sub)
    _add_status(sub)
    storeargs.add_parsers(sub)  # ls, restore, fsck: on a store, no mount (ckptfs/storetools.py)
    csi_cli.add_parser(sub)  # the Kubernetes CSI node plugin (ckptfs/csi/)
    setupnative.add_parser(sub)  # setup-native: the passthrough binding (ckptfs/native)
    _add_reference(sub)
    return p


# One function per subcommand (and per option group of `mount`); `sub` is build_parser's
# subparsers action.


def _add_mount(sub: argparse._SubParsersAction) -> None:
    m = sub.add_parser("mount", help="mount ckptfs at MOUNTPOINT",
                       description="Mount ckptfs. Returns once the mount answers (or fails "
                       "with a one-line reason and a documented exit code).")
    m.add_argument("mountpoint", type=Path, help="an existing, empty directory")
    m.add_argument("--cache-dir", type=Path, default=None,
                   help="local cache directory, ideally on NVMe: holds the data and the index "
                   "(default /var/cache/ckptfs for root, else $XDG_CACHE_HOME/ckptfs or "
                   "~/.cache/ckptfs); one mount per cache dir")
    m.add_argument("--foreground", "-f", action="store_true",
                   help="stay in the foreground and log to stderr (default: background)")
    m.add_argument("--log-file", type=Path, default=None,
                   help="log file (default: <cache-dir>/ckptfs.log in the background)")
    m.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS,
                   help="log verbosity; debug logs every refused operation (default info)")
    m.add_argument("--metrics", metavar="[ADDR:]PORT", default=None,
                   help="serve Prometheus metrics at http://ADDR:PORT/metrics (ADDR default "
                   "127.0.0.1; IPv6 as [ADDR]:PORT); off by default. A scrape costs the "
                   "daemon's loop about a millisecond")
    _add_mount_access(m)
    _add_mount_tuning(m)
    _add_mount_store(m)
    _add_mount_peers(m)


def _add_mount_peers(m: argparse.ArgumentParser) -> None:
    p = m.add_argument_group("peers (restore from other nodes' caches; docs/ARCHITECTURE.md "
                             "\"Peers\")")
    p.add_argument("--peers", action="store_true",
                   help="ask other live nodes of the store (its member records) for chunks "
                   "before the store, and serve this cache's verified chunks to them over "
                   "HTTP with HMAC authentication (no TLS); every chunk is checked against "
                   "its CRC32C, the store stays the fallback (default off)")
    p.add_argument("--peer-listen", metavar="[ADDR:]PORT", default=None,
                   help="where the peer server listens (default 0.0.0.0 and a port of the "
                   "kernel's choice, advertised in this node's member record)")
    p.add_argument("--peer-address", metavar="HOST", default=None,
                   help="the address other nodes reach this one at (default: this host's "
                   "primary IPv4 address)")
    p.add_argument("--peer-secret-file", type=Path, default=None,
                   help="file holding the secret every node shares (required with --peers; "
                   "mode 0600 or stricter; never written to the store or the log)")
    p.add_argument("--peer-seeds", metavar="HOST:PORT[,...]", default=None,
                   help="peers to ask for the replicas they hold when the store cannot be "
                   "listed (a fresh node finds no member records then); a name is resolved at "
                   "every ask and each of its addresses asked, and one answering peer names "
                   "the others it knows")
    p.add_argument("--replicas", metavar="K", type=_replicas, default=None,
                   help="copy every committed set to K other live nodes (its buddies) in the "
                   "background before the store has it (state `replicated`, which `ckptfs wait` "
                   "can wait for); costs K x each set's bytes of network and of the buddies' "
                   "cache space; 0: off (default 1 with --peers; needs --peers)")


def _replicas(s: str) -> int:
    try:
        k = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a number of nodes") from None
    if not 0 <= k <= 16:
        raise argparse.ArgumentTypeError(f"{k} is not from 0 to 16")
    return k


def _id(s: str) -> int:
    """--uid / --gid: a number (names differ between the host and a container)."""
    try:
        return int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a numeric id: {s!r}") from None


def _add_mount_access(m: argparse.ArgumentParser) -> None:
    a = m.add_argument_group("access (as mount-s3 spells it)")
    a.add_argument("--read-only", action="store_true",
                   help="mount read-only (-o ro): every change is refused with EROFS, the "
                   "store's checkpoints stay readable, and nothing is written to the store "
                   "(no upload, publish, delete, or membership record)")
    a.add_argument("--allow-other", action="store_true", default=None,
                   help="let every user use the mount (FUSE allow_other; default for a root "
                   "daemon; other daemons need user_allow_other in /etc/fuse.conf)")
    a.add_argument("--allow-root", action="store_true",
                   help="let only root and the mounting user use the mount (FUSE allow_root; "
                   "for a root daemon: root only)")
    a.add_argument("--uid", type=_id, default=None,
                   help="report every file and directory as owned by this uid (the kernel "
                   "checks permissions against it; chown to another uid is refused with "
                   "EPERM); default: each inode's own owner")
    a.add_argument("--gid", type=_id, default=None,
                   help="the same for the group")


def _add_mount_tuning(m: argparse.ArgumentParser) -> None:
    t = m.add_argument_group("tuning (defaults chosen by measurement, docs/ARCHITECTURE.md)")
    t.add_argument("--attr-timeout", type=_nonneg_float, default=10.0,
                   help="seconds the kernel caches attributes and names (default 10)")
    t.add_argument("--no-direct-io", dest="direct_io", action="store_false",
                   help="route writes through the kernel page cache (slower: ~2x more copies; "
                   "allows shared writable mmap)")
    t.add_argument("--writeback-cache", action="store_true",
                   help="enable the kernel writeback cache (implies --no-direct-io)")
    t.add_argument("--no-passthrough", dest="passthrough", action="store_false",
                   help="serve file data in the daemon even where FUSE passthrough works "
                   "(default: the kernel reads and writes whole cached files directly)")
    t.add_argument("--io-threads", type=int, default=0,
                   help="do data reads/writes in N worker threads (default 0: inline)")
    t.add_argument("--read-ahead-kb", type=int, default=1024,
                   help="kernel readahead for the mount in KiB (default 1024; 0 = kernel default)")


def _add_mount_store(m: argparse.ArgumentParser) -> None:
    o = m.add_argument_group("object store and tiering")
    o.add_argument("--store", default=None,
                   help="s3://bucket[/prefix] or file:///dir (default: the embedded file store "
                   "file:///var/lib/ckptfs/store for root, else in $XDG_DATA_HOME/ckptfs or "
                   "~/.local/share/ckptfs; shared by every such mount of the user)")
    storeargs.add_s3_options(o)  # --endpoint-url, --region, ... (and their older spellings)
    o.add_argument("--store-ignores-conditions", action="store_true",
                   help="mount even if the store is found to ignore conditional PUTs "
                   "(If-None-Match/If-Match, probed at mount): commits then write their "
                   "manifest unconditionally and the last node to commit a path wins; safe "
                   "only with one node writing each path (default: refuse such a store, "
                   "exit 7; docs/STORES.md)")
    o.add_argument("--s3-transfer", default="auto", type=str.lower,
                   choices=("auto", "crt", "boto3"),
                   help="which client moves the data of an s3:// store (docs/ARCHITECTURE.md "
                   "\"Store data path\"): auto uploads by plain HTTP with the body sent by "
                   "sendfile over an http:// endpoint, through the AWS Common Runtime (awscrt) "
                   "over https://, and restores through boto3 (each measured cheapest here); "
                   "crt through the CRT both ways; boto3 every byte through boto3. Without "
                   "awscrt, crt is boto3 and auto over https:// too, said by `ckptfs status` "
                   "(default auto)")
    o.add_argument("--compress", default="auto", type=str.lower,
                   choices=("auto", "lz4", "off"),
                   help="lz4 compression: auto samples each file and skips incompressible "
                   "ones (trained weights usually are) at ~no cost; lz4 always (costs CPU "
                   "for ~nothing on weights); off (default auto)")
    o.add_argument("--part-size", type=_size, default="64M",
                   help="multipart upload part size (default 64M; S3 allows 5M-5G and 10,000 "
                   "parts, so this also caps one file at 10,000 parts)")
    o.add_argument("--parts-in-flight", type=int, default=8,
                   help="parts uploading at once across all files; upload memory is about "
                   "part-size x this (default 8)")
    o.add_argument("--upload-files", type=int, default=4,
                   help="files uploading at once (default 4)")
    o.add_argument("--cache-size", type=_size, default=None,
                   help="file data to keep in the cache (e.g. 200G); beyond it durable data is "
                   "evicted and writers wait for uploads (default: the disk's size)")
    o.add_argument("--prefetch", default="auto", type=str.lower,
                   choices=PREFETCH_MODES,
                   help="what a node fetches ahead of its readers: set = the whole set when "
                   "one of its files is opened (fastest where this node reads all of it); "
                   "file = the file opened; reads = read-ahead of "
                   "sequential reads only (a node fetches ~what its ranks read); none = only "
                   "what reads cover; auto = set for a single-node restore, else reads for DCP "
                   "shards and file for other files (default auto)")
    o.add_argument("--no-prefetch", dest="prefetch", action="store_const", const="none",
                   help="same as --prefetch none")
    o.add_argument("--prefetch-concurrency", type=int, default=8,
                   help="GETs in flight per prefetch; memory is about prefetch-range x this "
                   "(default 8)")
    o.add_argument("--prefetch-range", type=_size, default="64M",
                   help="bytes per prefetch GET (runs of adjacent 4 MiB chunks; larger GETs "
                   "amortise the store's per-request cost; default 64M)")
    o.add_argument("--refresh-interval", type=_nonneg_float, default=10.0,
                   help="seconds between listings of the store's sets: sets committed by "
                   "other nodes appear within this (default 10; 0 = only at mount)")
    o.add_argument("--commit-timeout", type=_nonneg_float, default=1800.0,
                   help="seconds a commit waits for files written by other nodes (a DCP "
                   "checkpoint saved by several nodes) before the set fails; the previous "
                   "checkpoint stays (default 1800)")
    o.add_argument("--lease", type=_nonneg_float, default=120.0,
                   help="seconds after its last renewal in the store that a node counts as gone "
                   "to the others' directory commits; renewed every quarter of it. A node "
                   "that cannot renew in time registers again under a new generation "
                   "(default 120)")
    o.add_argument("--allow-empty-namespace", action="store_true",
                   help="mount even if the store's sets cannot be listed: the mount then shows "
                   "only this cache's sets, and with --peers the sets live peers hold "
                   "replicas of, until a listing succeeds (default: fail with exit 7, so a "
                   "resuming job never starts from an incomplete view)")
    o.add_argument("--keep-local", type=int, default=None,
                   help="keep only the newest N durable sets' data in the cache (older ones "
                   "are read back from the store on open)")


def _add_umount(sub: argparse._SubParsersAction) -> None:
    u = sub.add_parser("umount", help="unmount a ckptfs mount",
                       description="Wait until committed sets are durable in the store (with "
                       "a progress bar), then unmount and wait for the daemon to persist its "
                       "state.")
    u.add_argument("mountpoint", type=Path)
    u.add_argument("--no-wait", action="store_true",
                   help="do not wait for uploads; they resume at the next mount of this cache")
    u.add_argument("--timeout", type=_nonneg_float, default=None,
                   help="seconds for the whole unmount: the wait for uploads, then the "
                   "daemon's goodbye to the store within what is left (at least 1 s; default: "
                   "no limit); on timeout unmount anyway and exit 7")
    u.add_argument("--allow-unsaved", action="store_true",
                   help="exit 0 even if closed files in no committed set are left, only in "
                   "this cache dir (default: unmount, name them and exit 12; files uploaded "
                   "for another node's commit of their directory are named, exit 0)")


def _add_commit(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("commit", help="commit a file or directory as a shard set now")
    c.add_argument("path", type=Path)


def _add_prefetch(sub: argparse._SubParsersAction) -> None:
    pf = sub.add_parser("prefetch", help="fetch the set holding PATH (or everything under "
                        "PATH) into the cache now, in parallel, with a progress bar")
    pf.add_argument("path", type=Path)
    pf.add_argument("--no-wait", action="store_true", help="start it and return")


def _add_wait(sub: argparse._SubParsersAction) -> None:
    w = sub.add_parser("wait", help="wait until the set holding PATH is durable in the store; a "
                       "directory of several sets (one per file): every set under it")
    w.add_argument("path", type=Path)
    w.add_argument("--timeout", type=_nonneg_float, default=None,
                   help="seconds for the whole wait (default: no limit); exit 7 on timeout")
    w.add_argument("--replicated", action="store_true",
                   help="return once the set holding PATH is on K buddies' disks, fsynced "
                   "(--replicas), or durable: not durable (docs/SEMANTICS.md \"Replicated\"); "
                   "one set, not a directory of several")


def _add_status(sub: argparse._SubParsersAction) -> None:
    st = sub.add_parser("status", help="show what a mount's cache holds and its I/O counters",
                        usage="ckptfs status MOUNTPOINT [--json | --watch [SECONDS]]")
    # Optional here only so that `status --watch MOUNTPOINT` works (argparse gives --watch the
    # next word): cmd_status sorts the two out and requires a mount point.
    st.add_argument("mountpoint", type=Path, nargs="?")
    stv = st.add_mutually_exclusive_group()
    stv.add_argument("--json", action="store_true", help="machine-readable output")
    stv.add_argument("--watch", nargs="?", const=str(WATCH_DEFAULT), default=None,
                     metavar="SECONDS", help="redraw every SECONDS (default "
                     f"{WATCH_DEFAULT:g}) until Ctrl-C; one control-socket request each")


def _add_reference(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("completion", help="print a shell completion script (generated from "
                       "this parser)", description="Print the completion script for SHELL: "
                       "`ckptfs completion bash > /etc/bash_completion.d/ckptfs`, or `source "
                       "<(ckptfs completion bash)` in ~/.bashrc; for zsh, write it as _ckptfs "
                       "in a directory of $fpath.")
    c.add_argument("shell", choices=cliref.SHELLS)
    sub.add_parser("man", help="print the ckptfs(1) man page (generated from this parser)",
                   description="Print the man page in roff: `ckptfs man | man -l -`. "
                   "docs/ckptfs.1 is the same page (scripts/gen_man.py writes it).")


def mount_parser() -> argparse.ArgumentParser:
    """The `ckptfs mount` parser: `mount.fuse.ckptfs` (ckptfs/mounthelper.py) derives its `-o`
    options from it, so an option added here is spellable in fstab without more code."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["mount"]


def _fail(code: int, msg: str) -> int:
    print(f"ckptfs: {msg}", file=sys.stderr)
    return code


def cmd_mount(a: argparse.Namespace) -> int:
    endpoint, region = s3_from_env(a.s3_endpoint, a.s3_region)
    try:
        cfg = MountConfig(
            store=a.store, s3_endpoint=endpoint, s3_region=region,
            s3_path_style=a.s3_path_style, s3_profile=a.s3_profile, compress=a.compress,
            part_size=a.part_size, parts_in_flight=a.parts_in_flight,
            upload_files=a.upload_files, cache_size=a.cache_size,
            keep_local=a.keep_local, prefetch=a.prefetch,
            prefetch_concurrency=a.prefetch_concurrency,
            prefetch_range=a.prefetch_range,
            refresh_interval=a.refresh_interval, commit_timeout=a.commit_timeout,
            lease=a.lease,
            allow_empty_namespace=a.allow_empty_namespace,
            store_ignores_conditions=a.store_ignores_conditions,
            s3_transfer=a.s3_transfer,
            metrics=a.metrics,
            peers=a.peers, peer_listen=a.peer_listen, peer_address=a.peer_address,
            peer_seeds=a.peer_seeds,
            replicas=a.replicas,
            peer_secret_file=a.peer_secret_file.absolute() if a.peer_secret_file else None,
            mountpoint=a.mountpoint.absolute(),
            cache_dir=(a.cache_dir or default_cache_dir()).absolute(),
            foreground=a.foreground,
            log_file=a.log_file.absolute() if a.log_file else None,
            log_level=a.log_level,
            attr_timeout=a.attr_timeout,
            direct_io_writes=a.direct_io,
            writeback_cache=a.writeback_cache,
            passthrough=a.passthrough,
            io_threads=a.io_threads,
            read_ahead_kb=a.read_ahead_kb,
            read_only=a.read_only, allow_other=a.allow_other, allow_root=a.allow_root,
            uid=a.uid, gid=a.gid,
        )
    except ConfigError as e:
        return _fail(EXIT_USAGE, str(e))
    try:
        check_fuse()
        check_overlap(cfg.cache_dir, cfg.mountpoint, cfg.log_file)
        check_mountpoint(cfg.mountpoint)
        check_runtime_dir()
        check_cache_dir(cfg.cache_dir)
    except MountError as e:
        return _fail(e.code, e.msg)
    if cfg.foreground:
        setup_logging(cfg)

        def notify(code: int, msg: str) -> None:
            print(f"ckptfs: {msg}", file=sys.stderr)

        return run_daemon(cfg, notify)
    code, msg = start(cfg, run_daemon)
    if code != EXIT_OK:
        return _fail(code, msg)
    print(f"ckptfs: {msg}")
    return EXIT_OK


def cmd_umount(a: argparse.Namespace) -> int:
    from . import ui  # rich: imported by the commands that draw, not by mount/commit/wait

    mp = a.mountpoint.absolute()
    started = time.monotonic()
    drained = True
    entry = find_mount(mp)
    ours = entry is not None and entry["fstype"] == "fuse.ckptfs"
    if not a.no_wait and ours:
        try:
            drained = ui.drain(mp, a.timeout)
        except api.CkptfsError as e:
            ui.note(f"not waiting for uploads: {e}")
    if a.timeout is not None and ours:
        # the daemon's own goodbye to the store (Members.leave) within what is left, so that
        # the whole unmount ends by --timeout (a hung store made it 10 s late, issue 36)
        try:
            api.leave_by(mp, a.timeout - (time.monotonic() - started))
        except api.CkptfsError:
            pass  # a daemon that does not answer is unmounted all the same
    unsaved, only_here = _unsaved(mp)  # asked before the daemon goes: nothing asks it after
    code, msg = umount(mp)
    if code != EXIT_OK:
        return ui.fail(code, msg)
    if not drained:
        return ui.fail(EXIT_STORE, f"{msg}, but uploads were still pending after {a.timeout}s; "
                     "they resume at the next mount of this cache dir" +
                     (f"; and {unsaved}" if unsaved else ""))
    if only_here and not a.allow_unsaved:
        return ui.fail(EXIT_UNSAVED, f"{msg}, but {unsaved}")
    if unsaved and not a.allow_unsaved:
        # every one of them is in the store, named in a part record for another node's commit
        # of its directory (a rank's shards of a set another node publishes): said, not failed
        ui.note(unsaved)
    ui.result(f"ckptfs: {msg}")
    return EXIT_OK


def _unsaved(mp: Path) -> tuple[str | None, int]:
    """`umount`: the mount's closed files in no committed set, said in one line, and how many
    of them are only in this cache (not uploaded for another node's commit). (None, 0): none,
    or the daemon did not answer (it is unmounted all the same)."""
    from . import ui

    try:
        t = api.status(mp).get("tiering", {})
    except api.CkptfsError:
        return None, 0
    if not t.get("unsaved_files"):
        return None, 0
    paths = [ui.safe(p) for p in t.get("unsaved", [])[:5]]
    more = t["unsaved_files"] - len(paths)
    return (ui.unsaved_words(t) + ": " + ", ".join(paths) + (f" and {more} more" if more > 0
                                                              else "")), \
        t["unsaved_files"] - t.get("handed_files", 0)


def cmd_commit(a: argparse.Namespace) -> int:
    try:
        seq = api.commit(a.path)
    except api.CkptfsError as e:
        return _fail(e.code, str(e))
    print(f"ckptfs: committed {a.path} as set {seq}")
    return EXIT_OK


def cmd_prefetch(a: argparse.Namespace) -> int:
    from . import ui

    try:
        job = api.prefetch(a.path)
        if a.no_wait or job["finished"]:
            ui.result(f"ckptfs: prefetch of {ui.safe(job['path'])}: {job['files']} files, "
                      f"{ui.human(job['bytes_total'])}" + (" (already cached)" if job["finished"]
                                                           else " started"))
            return EXIT_OK
        mp, _ = api.locate(a.path)
        j, took = ui.prefetch(mp, job)
    except api.CkptfsError as e:
        return ui.fail(e.code, str(e))
    if j.get("error"):
        return ui.fail(EXIT_ERROR, f"prefetch of {j['path']} incomplete: {j['error']}")
    ui.result(f"ckptfs: prefetched {ui.safe(j['path'])}: {j['files']} files, "
              f"{ui.human(j['bytes_total'])} in {took:.1f}s")
    return EXIT_OK


def cmd_wait(a: argparse.Namespace) -> int:
    try:
        r = api.wait_replicated(a.path, timeout=a.timeout) if a.replicated else \
            api.wait_durable(a.path, timeout=a.timeout)
    except api.CkptfsError as e:
        return _fail(e.code, str(e))
    if r.get("state") == "replicated":
        print(f"ckptfs: {r['path']} is replicated (set {r['seq']}); not durable yet")
        return EXIT_OK
    if "sets" in r:  # a directory of several sets
        n = r["sets"]
        print(f"ckptfs: {a.path}: {n} set{'' if n == 1 else 's'} durable")
    else:
        print(f"ckptfs: {r['path']} is durable (set {r['seq']})")
    return EXIT_OK


def cmd_status(a: argparse.Namespace) -> int:
    from . import ui

    mp, interval = a.mountpoint, None
    if a.watch is not None:
        try:
            interval = _interval(a.watch)
        except argparse.ArgumentTypeError as e:
            if mp is not None:
                return ui.fail(EXIT_USAGE, f"argument --watch: {e} (see ckptfs status --help)")
            mp, interval = Path(a.watch), WATCH_DEFAULT  # `status --watch MOUNTPOINT`
    if mp is None:
        return ui.fail(EXIT_USAGE, "the following arguments are required: mountpoint "
                     "(see ckptfs status --help)")
    mp = mp.absolute()
    entry = find_mount(mp)
    if entry is None or entry["fstype"] != "fuse.ckptfs":
        return ui.fail(EXIT_MOUNTPOINT, f"{mp} is not a ckptfs mount")
    if interval is not None:
        return ui.watch_status(mp, interval)
    try:
        st = api.status(mp)
    except api.CkptfsError as e:
        return ui.fail(e.code, str(e))
    if a.json:
        return ui.print_json(json.dumps(st, indent=2, sort_keys=True))
    return ui.print_status(st)


def _store_tools(args: argparse.Namespace) -> int:
    from . import storetools  # reads stores: imported by these commands only

    return storetools.run(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "mount":
            return cmd_mount(args)
        if args.cmd == "umount":
            return cmd_umount(args)
        if args.cmd == "status":
            return cmd_status(args)
        if args.cmd == "commit":
            return cmd_commit(args)
        if args.cmd == "wait":
            return cmd_wait(args)
        if args.cmd == "prefetch":
            return cmd_prefetch(args)
        if args.cmd == "csi":
            return csi_cli.run(args)
        if args.cmd in ("ls", "restore", "fsck"):
            return _store_tools(args)
        if args.cmd == "setup-native":
            return setupnative.run(args)
        if args.cmd in ("completion", "man"):
            sys.stdout.write(cliref.render(getattr(args, "shell", "man"), build_parser()))
            return EXIT_OK
    except KeyboardInterrupt:
        return _fail(EXIT_ERROR, "interrupted")
    except Exception as e:  # noqa: BLE001 (never a traceback on the terminal)
        return _fail(EXIT_ERROR, f"unexpected error: {e.__class__.__name__}: {e}")
    return _fail(EXIT_USAGE, f"unknown command {args.cmd}")
