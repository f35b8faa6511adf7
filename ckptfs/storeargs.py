"""The command line of the store tools (`ckptfs ls`, `restore`, `fsck`): their arguments only,
so that every `ckptfs` command builds its parser without importing the tools themselves
(ckptfs/storetools.py, which reads stores). `--parallel` left out is None here: the tools take
cachemgr.format.resumable.DEFAULT_WORKERS (8)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

# docs/FORMAT.md: lifecycle rules may delete protocol keys after a day
DEFAULT_OLDER_THAN = 86400.0
GARBAGE_RULE = (
    "A live mount may be uploading right now: an object not yet named by any manifest because "
    "its set is still being published is not garbage: only objects older than --older-than "
    "(store LastModified / mtime) count as garbage, and fsck re-checks that no manifest names "
    "an object right before deleting it.")



def seconds(s: str) -> float:
    """An option's seconds: a finite number >= 0 (argparse names the option in the error)."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {s!r}") from None
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0: {s!r}")
    return v


def _workers(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {s!r}") from None
    if not 1 <= v <= 256:
        raise argparse.ArgumentTypeError(f"must be between 1 and 256: {s}")
    return v


# The S3 options of `ckptfs mount` and of the store tools: the AWS CLI's and mount-s3's
# spellings first, ckptfs's older ones kept as aliases (same dest, same meaning). Values left
# out fall back to the AWS environment (ckptfs.config.s3_from_env), then to the AWS config files.
S3_OPTIONS: tuple[tuple[tuple[str, ...], dict[str, Any]], ...] = (
    (("--endpoint-url", "--s3-endpoint"), {
        "dest": "s3_endpoint", "metavar": "URL", "default": None,
        "help": "S3 endpoint URL for S3-compatible stores (MinIO, Ceph, ...); default "
        "$AWS_ENDPOINT_URL_S3, $AWS_ENDPOINT_URL, then the AWS config file"}),
    (("--region", "--s3-region"), {
        "dest": "s3_region", "metavar": "REGION", "default": None,
        "help": "S3 region; default $AWS_REGION, $AWS_DEFAULT_REGION, then the AWS config "
        "file"}),
    (("--force-path-style", "--s3-path-style"), {
        "dest": "s3_path_style", "action": "store_true",
        "help": "path-style S3 addressing (http://host/bucket/key), as most S3-compatible "
        "stores want"}),
    (("--profile", "--s3-profile"), {
        "dest": "s3_profile", "metavar": "PROFILE", "default": None,
        "help": "AWS profile name; default $AWS_PROFILE. Credentials always come from the AWS "
        "chain (environment, config files, profile, instance role)"}),
)


def add_s3_options(group) -> None:
    """Add the S3 options (S3_OPTIONS) to an argument group or parser."""
    for flags, kw in S3_OPTIONS:
        group.add_argument(*flags, **kw)


def _store_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", metavar="STORE",
                   help="the store, as `ckptfs mount --store` takes it: s3://bucket[/prefix] "
                   "or file:///dir")
    add_s3_options(p.add_argument_group(
        "S3 (as for `ckptfs mount`; the second spelling of each is an alias)"))


def add_parsers(sub) -> None:
    """Register `ls`, `restore` and `fsck` on the `ckptfs` subparsers."""
    ls = sub.add_parser(
        "ls", help="list the checkpoints published in a store (no mount needed)",
        description="List the shard sets published in STORE under PATH (all if omitted): "
        "size, files, committing node(s), commit time, compression ratio (stored/raw). A "
        "manifest that fails validation is listed as invalid with the reason. Exit 0; 7 "
        "store unusable; 8 nothing at PATH.")
    _store_args(ls)
    ls.add_argument("path", metavar="PATH", nargs="?", default=None,
                    help="a set path or a directory of sets, as in the mount (e.g. ckpt)")
    ls.add_argument("--json", action="store_true", help="machine-readable output")

    r = sub.add_parser(
        "restore", help="restore a checkpoint from a store into a directory (no mount needed)",
        description="Restore set SET of STORE at DEST/SET: parallel ranged GETs, every chunk "
        "checked against its CRC32C as it arrives and every file read back and checked "
        "whole before it takes its place; a progress bar on a terminal. Resumable: a rerun "
        "after an interruption fetches only what is missing or fails its check (its state is "
        "in DEST/.ckptfs-restore). A rerun over a restored set repairs it. Never writes "
        "outside DEST and never follows a symlink there; an existing file that restore did not "
        "put there and that holds other content is refused unless --overwrite. Exit 0 done; "
        "1 interrupted (rerun to resume); 2 usage; 7 store unusable; 8 no such set; 10 the set "
        "is damaged in the store; 11 the destination refused.")
    _store_args(r)
    r.add_argument("set", metavar="SET", help="the set's path as in the mount (ckpt/step_100),"
                   " or as `ckptfs ls` prints it")
    r.add_argument("dest", metavar="DEST", type=Path,
                   help="directory to restore into (created if missing); the set goes to "
                   "DEST/SET, so links between sets (`latest`) keep working")
    r.add_argument("--overwrite", action="store_true",
                   help="replace files (and symlinks) at the set's paths that hold other "
                   "content, even if restore did not put them there")
    r.add_argument("--parallel", type=_workers, default=None,
                   help="ranged GETs in flight (default 8; memory is about 8 MiB each)")

    f = sub.add_parser(
        "fsck", help="check a store; list (and with --repair delete) its garbage",
        description="Check that every manifest in STORE is valid and every object it names is "
        "there with the right size (--verify: and the right CRC32C, by reading it). List as "
        "garbage: objects under data/ that no manifest (and no kept part record) names, and "
        "part, member, intent and ack records of nodes not seen (no member record renewed) for "
        "longer than --older-than; --repair deletes the garbage, and never an object a "
        "manifest names. " + GARBAGE_RULE + " Exit 0: no damage (garbage found but not "
        "repaired is still 0); 7 store unusable or a deletion failed; 10 damage found.")
    _store_args(f)
    f.add_argument("--verify", action="store_true",
                   help="also read every object a manifest names and check its CRC32C (and "
                   "chunk CRC32Cs, lz4 frames): reads the whole store")
    f.add_argument("--repair", action="store_true",
                   help="delete the garbage found (never an object a manifest names; see above)")
    f.add_argument("--older-than", type=seconds, default=DEFAULT_OLDER_THAN, metavar="SECONDS",
                   help="how old (store LastModified / mtime) unreferenced objects and records "
                   "of nodes not seen must be to count as garbage (default 86400: 24 h). Choose "
                   "it above --commit-timeout and above the longest time a file may stay "
                   "uploaded but uncommitted (a *.tmp directory renamed later)")
    f.add_argument("--parallel", type=_workers, default=None,
                   help="objects read at once with --verify (default 8)")
