"""`mount.fuse.ckptfs`: the mount(8) helper, so ckptfs mounts from /etc/fstab and with
`mount -t fuse.ckptfs SOURCE DIR -o OPTS`.

mount(8) runs `/sbin/mount.fuse.ckptfs SOURCE DIR [-sfnv] [-N NS] [-o OPTS] [-t fuse.ckptfs]`
(util-linux mount(8), "EXTERNAL HELPERS"; it strips `auto`, `noauto`, `comment=` and `x-*`
itself). This module turns that into the argv of `ckptfs mount` and runs the CLI's own entry
point, `ckptfs.cli.main`: one code path for both (MountConfig, the preflight checks, the daemon's
start), and like `ckptfs mount` it returns once the mount answers.

The `-o` spellings are derived from the `ckptfs mount` parser (`ckptfs.cli.mount_parser`), not
listed here: `--some-option VALUE` is `some_option=VALUE`, a flag `--no-thing` is `no_thing`.
An option added to the parser is therefore spellable in fstab with no change here
(tests/unit/test_fstab.py checks every one). SOURCE is the store: `s3://...` or `file:///...` (the
same as `store=`), or `ckptfs`/`none` for the default store.

`ro` is `read_only` (`--read-only`); `allow_other`, `allow_root`, `uid=`, `gid=` are `ckptfs
mount` options of those names, as for mount-s3 and other FUSE filesystems.

Generic mount options that say nothing to ckptfs (`defaults`, `rw`, `_netdev`, `nofail`, the
`user` family, which mount(8) itself enforces) are accepted and ignored, and so are `nosuid` and
`nodev`, which every FUSE mount has anyway. Anything else unknown is a one-line error, exit 2
(with `-s`, mount(8)'s "sloppy", a warning). The helper never unmounts: plain `umount` unmounts
without waiting for uploads (they resume at the next mount of the cache dir), `ckptfs umount`
waits for them (README "fstab and systemd").

State: none; it runs once per mount(8) call and hands over to `ckptfs.cli.main`.
"""

from __future__ import annotations

import argparse
import sys

from .mount import EXIT_OK, EXIT_USAGE

PROG = "mount.fuse.ckptfs"

# Options that mean nothing to ckptfs, or that hold for every ckptfs mount already (FUSE mounts
# are always nosuid,nodev: libfuse/fusermount3 add them). mount(8) normally strips auto, noauto,
# comment= and x-*; they are here too for a direct call of the helper.
IGNORED = frozenset({
    "defaults", "rw", "auto", "noauto", "_netdev", "nofail", "user", "users", "nouser",
    "owner", "group", "nosuid", "nodev",
})
IGNORED_PREFIXES = ("x-", "comment=")

# Generic mount options that are ckptfs options under another name: `ro` (mount -r, fstab) is
# --read-only. (`rw` is the default, among IGNORED.)
GENERIC = {"ro": "read_only"}

# SOURCE words for "the default store" (ckptfs.config.default_store_url).
DEFAULT_SOURCES = ("ckptfs", "none")


class UsageError(Exception):
    """A bad helper command line or -o option: one line, EXIT_USAGE."""


def mount_options() -> dict[str, tuple[str, argparse.Action]]:
    """-o name -> (the `ckptfs mount` long option, its parser action): every long option of the
    parser, `--cache-dir` as `cache_dir`, `--no-passthrough` as `no_passthrough`."""
    from .cli import mount_parser

    out: dict[str, tuple[str, argparse.Action]] = {}
    for act in mount_parser()._actions:
        if isinstance(act, argparse._HelpAction):
            continue
        for opt in act.option_strings:
            if opt.startswith("--"):
                out[opt[2:].replace("-", "_")] = (opt, act)
    return out


def split_options(text: str) -> list[str]:
    """'a,b=1,c="x,y"' -> ['a', 'b=1', 'c=x,y']: comma-separated, a double-quoted value may hold
    commas (libmount's quoting)."""
    items: list[str] = []
    cur: list[str] = []
    quoted = False
    for ch in text:
        if ch == '"':
            quoted = not quoted
        elif ch == "," and not quoted:
            items.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if quoted:
        raise UsageError(f"unbalanced quote in mount options {text!r}")
    items.append("".join(cur))
    return [i for i in items if i]


def translate(source: str, target: str, options: list[str], *,
              sloppy: bool = False) -> tuple[list[str], list[str]]:
    """(argv of `ckptfs` for this mount, warnings). Raises UsageError."""
    known = mount_options()
    args: list[str] = []
    warnings: list[str] = []
    store = None
    for item in options:
        name, eq, value = item.partition("=")
        if item in IGNORED or item.startswith(IGNORED_PREFIXES):
            continue
        if name not in known and GENERIC.get(name) not in known:
            if sloppy:
                warnings.append(f"ignoring unknown mount option {item!r} (-s)")
                continue
            raise UsageError(f"unknown mount option {name!r} (see {PROG} --help)")
        opt, act = known[GENERIC.get(name, name)]
        if act.nargs == 0:  # a flag: store_true/store_false
            if eq:
                raise UsageError(f"mount option {name!r} takes no value")
            args.append(opt)
        else:
            if not value:
                raise UsageError(f"mount option {name!r} needs a value: {name}=...")
            if act.dest == "store":
                store = value
                continue
            args.append(f"{opt}={value}")  # one word: a value starting with '-' stays a value
    if source.startswith(("s3://", "file://")):
        if store is not None and store != source:
            raise UsageError(f"SOURCE {source} and store={store} disagree; give one of them")
        store = source
    elif source not in DEFAULT_SOURCES:
        raise UsageError(f"SOURCE must be s3://bucket[/prefix], file:///dir, or "
                         f"{'/'.join(DEFAULT_SOURCES)} for the default store, not {source!r}")
    return ["mount", target, *(["--store", store] if store else []), *args], warnings


def usage() -> str:
    opts = []
    for name, (_, act) in sorted(mount_options().items()):
        meta = act.metavar if isinstance(act.metavar, str) and act.metavar else act.dest
        opts.append(name if act.nargs == 0 else f"{name}=" + meta.upper())
    return (f"usage: {PROG} SOURCE DIR [-sfnv] [-o OPTIONS] [-t fuse.ckptfs]\n"
            "  (run by mount(8) for fstab type fuse.ckptfs and for mount -t fuse.ckptfs)\n"
            "SOURCE: s3://bucket[/prefix], file:///dir, or ckptfs / none (the default store)\n"
            "  -f  fake: check the options, do not mount   -s  sloppy: warn about unknown options\n"
            "  -v  print the `ckptfs mount` command line  -n  accepted (no /etc/mtab is written)\n"
            "OPTIONS (comma-separated; each is a `ckptfs mount` option, see ckptfs mount --help):\n"
            + "".join(f"  {o}\n" for o in opts)
            + "".join(f"  {g} (= {n})\n" for g, n in GENERIC.items())
            + f"ignored: {', '.join(sorted(IGNORED))}, x-*, comment=*\n")


def parse_argv(argv: list[str]) -> dict:
    """The helper's own command line, as mount(8) and people write it (options may come before
    or after SOURCE DIR, flags may be combined, -o may repeat)."""
    pos: list[str] = []
    opts: list[str] = []
    flags: set[str] = set()
    fstype = None
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("-h", "--help"):
            flags.add("h")
        elif a in ("-o", "-t", "-N"):
            if i + 1 >= len(argv):
                raise UsageError(f"{a} needs an argument")
            i += 1
            if a == "-o":
                opts += split_options(argv[i])
            elif a == "-t":
                fstype = argv[i]
            else:
                raise UsageError("-N (mount in another namespace) is not supported")
        elif a.startswith("-o") and len(a) > 2:
            opts += split_options(a[2:])
        elif a.startswith("-t") and len(a) > 2:
            fstype = a[2:]
        elif a.startswith("-") and len(a) > 1 and a != "--":
            for ch in a[1:]:
                if ch not in "sfnv":
                    raise UsageError(f"unknown flag -{ch} (see {PROG} --help)")
                flags.add(ch)
        elif a != "--":
            pos.append(a)
        i += 1
    if "h" in flags:
        return {"help": True}
    if fstype not in (None, "fuse.ckptfs", "ckptfs"):
        raise UsageError(f"-t {fstype}: this is the helper of fuse.ckptfs")
    if len(pos) != 2:
        raise UsageError(f"expected SOURCE and DIR, got {len(pos)} argument(s) "
                         f"(see {PROG} --help)")
    return {"help": False, "source": pos[0], "target": pos[1], "options": opts, "flags": flags}


def main(argv: list[str] | None = None) -> int:
    from .cli import main as ckptfs_main
    from .cli import mount_parser

    try:
        a = parse_argv(sys.argv[1:] if argv is None else argv)
        if a["help"]:
            print(usage(), end="")
            return EXIT_OK
        args, warnings = translate(a["source"], a["target"], a["options"],
                                   sloppy="s" in a["flags"])
    except UsageError as e:
        print(f"ckptfs: {e}", file=sys.stderr)
        return EXIT_USAGE
    for w in warnings:
        print(f"ckptfs: {w}", file=sys.stderr)
    if "v" in a["flags"]:
        print(f"{PROG}: ckptfs {' '.join(args)}", file=sys.stderr)
    if "f" in a["flags"]:
        # mount -f: everything but the mount; the parser checks every value (exit 2 if bad).
        mount_parser().parse_args(args[1:])
        return EXIT_OK
    return ckptfs_main(args)


if __name__ == "__main__":
    sys.exit(main())
