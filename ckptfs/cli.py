"""The `ckptfs` command line. Builds a frozen `MountConfig` and hands it to `ckptfs.mount`.

Every failure prints one line, `ckptfs: <reason>`, on stderr and exits with a documented code
(README "Exit codes", constants in `ckptfs.mount`). Tracebacks never reach the user.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import __version__, control
from .config import LOG_LEVELS, ConfigError, MountConfig, default_cache_dir
from .mount import (
    EXIT_ERROR,
    EXIT_MOUNTPOINT,
    EXIT_OK,
    EXIT_USAGE,
    MountError,
    check_cache_dir,
    check_fuse,
    check_mountpoint,
    find_mount,
    registration,
    run_daemon,
    setup_logging,
    start,
    umount,
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, documented code, no usage dump
        print(f"ckptfs: {message} (see ckptfs {self.prog.split()[-1]} --help)"
              if " " in self.prog else f"ckptfs: {message} (see ckptfs --help)", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _nonneg_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {s!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {s}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="ckptfs", description="FUSE checkpoint filesystem for ML training.")
    p.add_argument("--version", action="version", version=f"ckptfs {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    m = sub.add_parser("mount", help="mount ckptfs at MOUNTPOINT",
                       description="Mount ckptfs. Returns once the mount answers (or fails "
                       "with a one-line reason and a documented exit code).")
    m.add_argument("mountpoint", type=Path, help="an existing, empty directory")
    m.add_argument("--cache-dir", type=Path, default=None,
                   help="local cache directory, ideally on NVMe: holds the data and the index "
                   f"(default {default_cache_dir()}); one mount per cache dir")
    m.add_argument("--foreground", "-f", action="store_true",
                   help="stay in the foreground and log to stderr (default: background)")
    m.add_argument("--log-file", type=Path, default=None,
                   help="log file (default: <cache-dir>/ckptfs.log in the background)")
    m.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS,
                   help="log verbosity; debug logs every refused operation (default info)")
    t = m.add_argument_group("tuning (defaults chosen by measurement, docs/ARCHITECTURE.md)")
    t.add_argument("--attr-timeout", type=_nonneg_float, default=10.0,
                   help="seconds the kernel caches attributes and names (default 10)")
    t.add_argument("--no-direct-io", dest="direct_io", action="store_false",
                   help="route writes through the kernel page cache (slower: ~2x more copies; "
                   "allows shared writable mmap)")
    t.add_argument("--writeback-cache", action="store_true",
                   help="enable the kernel writeback cache (implies --no-direct-io)")
    t.add_argument("--io-threads", type=int, default=0,
                   help="do data reads/writes in N worker threads (default 0: inline)")
    t.add_argument("--read-ahead-kb", type=int, default=1024,
                   help="kernel readahead for the mount in KiB (default 1024; 0 = kernel default)")

    u = sub.add_parser("umount", help="unmount a ckptfs mount",
                       description="Unmount and wait for the daemon to persist its state.")
    u.add_argument("mountpoint", type=Path)
    u.add_argument("--timeout", type=_nonneg_float, default=300.0,
                   help="seconds to wait for the daemon to finish (default 300)")
    st = sub.add_parser("status", help="show what a mount's cache holds and its I/O counters")
    st.add_argument("mountpoint", type=Path)
    st.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def _fail(code: int, msg: str) -> int:
    print(f"ckptfs: {msg}", file=sys.stderr)
    return code


def cmd_mount(a: argparse.Namespace) -> int:
    try:
        cfg = MountConfig(
            mountpoint=a.mountpoint.absolute(),
            cache_dir=(a.cache_dir or default_cache_dir()).absolute(),
            foreground=a.foreground,
            log_file=a.log_file.absolute() if a.log_file else None,
            log_level=a.log_level,
            attr_timeout=a.attr_timeout,
            direct_io_writes=a.direct_io,
            writeback_cache=a.writeback_cache,
            io_threads=a.io_threads,
            read_ahead_kb=a.read_ahead_kb,
        )
    except ConfigError as e:
        return _fail(EXIT_USAGE, str(e))
    try:
        check_fuse()
        check_mountpoint(cfg.mountpoint)
        check_cache_dir(cfg.cache_dir)
    except MountError as e:
        return _fail(e.code, e.msg)
    if cfg.foreground:
        setup_logging(cfg)

        def notify(code: int, msg: str) -> None:
            print(f"ckptfs: {msg}", file=sys.stderr)

        return run_daemon(cfg, notify)
    code, msg = start(cfg)
    if code != EXIT_OK:
        return _fail(code, msg)
    print(f"ckptfs: {msg}")
    return EXIT_OK


def cmd_umount(a: argparse.Namespace) -> int:
    code, msg = umount(a.mountpoint.absolute(), timeout=a.timeout)
    if code != EXIT_OK:
        return _fail(code, msg)
    print(f"ckptfs: {msg}")
    return EXIT_OK


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def cmd_status(a: argparse.Namespace) -> int:
    mp = a.mountpoint.absolute()
    entry = find_mount(mp)
    if entry is None or entry["fstype"] != "fuse.ckptfs":
        return _fail(EXIT_MOUNTPOINT, f"{mp} is not a ckptfs mount")
    reg = registration(mp)
    if reg is None:
        return _fail(EXIT_ERROR, f"no daemon registered for {mp} (it may have died)")
    try:
        st = control.request(Path(reg["control"]), {"op": "status"})
    except (OSError, ValueError) as e:
        return _fail(EXIT_ERROR, f"daemon for {mp} (pid {reg['pid']}) is not answering: {e}")
    if "error" in st:
        return _fail(EXIT_ERROR, st["error"])
    if a.json:
        print(json.dumps(st, indent=2, sort_keys=True))
        return EXIT_OK
    c, io = st["cache"], st["io"]
    avg = io["bytes_written"] / io["write_requests"] if io["write_requests"] else 0
    print(f"mount      {st['mountpoint']} (pid {st['pid']}, up {st['uptime_s']:.0f}s)")
    print(f"cache dir  {st['cache_dir']}: {c['files']} files, {c['dirs']} dirs, "
          f"{c['symlinks']} symlinks, {_human(c['bytes'])}; disk free "
          f"{_human(c['disk_free_bytes'])} of {_human(c['disk_total_bytes'])}")
    print(f"I/O        {io['write_requests']} writes ({_human(io['bytes_written'])}, "
          f"avg {_human(avg)}), {io['read_requests']} reads ({_human(io['bytes_read'])}), "
          f"{io['fsyncs']} fsyncs; {c['open_handles']} open handles")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "mount":
            return cmd_mount(args)
        if args.cmd == "umount":
            return cmd_umount(args)
        if args.cmd == "status":
            return cmd_status(args)
    except KeyboardInterrupt:
        return _fail(EXIT_ERROR, "interrupted")
    except Exception as e:  # never a traceback on the terminal
        return _fail(EXIT_ERROR, f"unexpected error: {e.__class__.__name__}: {e}")
    return _fail(EXIT_USAGE, f"unknown command {args.cmd}")
