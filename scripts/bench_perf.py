#!/usr/bin/env python3
"""ckptfs end-to-end performance benchmark: the numbers of docs/PERFORMANCE.md.

Entry point: `bash scripts/bench.sh [--quick|--full]` (installs the extras, then runs this).

What it measures, all in one run, against one S3 store (a moto_server on 127.0.0.1 started
here) and on the same data:

  fio        scripts/fio/{write,read_warm,read_cold}.fio at 1, 4 and 8 writers: 1 MiB
             sequential writes of incompressible data (refill_buffers) with end_fsync=1, a read
             right after (page cache warm) and a read after sync + drop_caches; through a
             ckptfs mount of each ckptfs target (below) and on the raw cache disk, back to back
             (order rotated), reported as mount/raw.
  mlperf     an MLPerf-Storage-like checkpoint: R rank processes, each `torch.save`s its shard
             (fp16 model + fp32 optimizer state: master weights and two Adam moments) and
             fsyncs it, into `step_N.tmp/`, renamed to `step_N/` when every rank is done.
  dcp        torch.distributed.checkpoint save/load of a GPT-like state dict (embedding +
             transformer blocks, fp32), FileSystemWriter(thread_count=T, sync_files=True).

  For both torch workloads, per target: `save` (time until the trainer has control back),
  `durable` (time from the save's start until every byte is in the store), `warm` restore
  (same node, page cache dropped) and `cold` restore (a fresh node: empty cache, new mount).
  Targets (the peers):
    raw        the raw cache disk: the ceiling for save and warm restore
    ckptfs     `ckptfs mount --store s3://...` (durable: ckptfs.wait_durable): the default data
               path, FUSE passthrough (the kernel reads/writes whole cached files directly)
    ckptfs-fuse  the same with `--no-passthrough`: the daemon serves every byte (user space)
               Both ckptfs targets run in every section (fio, mlperf, dcp, profiles); the data
               path each mount actually ran (`ckptfs status --json` -> data_path: mode,
               off_reason, passthrough opens) is recorded per mount and per run.
    s3fs       s3fs-fuse with its local cache (use_cache=DIR), defaults otherwise
    rclone     rclone mount --vfs-cache-mode writes, defaults otherwise
    s3torch    (dcp only) s3torchconnector's S3StorageWriter/S3StorageReader straight to S3
    ceiling    boto3's transfer manager moving the same files up and down (64 MiB parts,
               8 in flight, all files at once): the store's own ceiling
  For peers, `durable` is polled in the store (every object present with its full size).
  A peer that cannot run is reported as "not available: <reason>", never estimated.

  The ckptfs daemon's RSS is sampled every 0.1 s during every run (peak reported, with the
  bytes that went through that mount). A last section records py-spy profiles of the daemon
  during a fio write, a fio read after drop_caches and a cold restore, for each ckptfs target.

Method: repeats (quick 1, full 3) with the target order rotated per repeat; medians with
min/max; ratios are computed per repeat from back-to-back runs, then the median taken.
os.getloadavg() is recorded at the start and end of every measurement. Before every timed
run: sync, then touch+free some anonymous memory (see scripts/bench_fio.py for why).
Reads that compare restores drop the page cache (sync; echo 3 > /proc/sys/vm/drop_caches).

Output: --out (default bench-results/perf): results.json, results.md, profiles; and unless
--no-docs: docs/PERFORMANCE.md, docs/bench/perf.json, docs/bench/perf-*.png.
"""


from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import traceback
from pathlib import Path
from types import FrameType
from typing import NoReturn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import loadavg
from perf_core import CKPTFS_TARGETS, REPO, Perf
from perf_fio import FioBench
from perf_peers import Peers
from perf_profile import Profiles
from perf_torch import TorchBench

# ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_perf.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="< 5 minutes: 256 MiB, 1 repeat")
    g.add_argument("--full", action="store_true",
                   help="fio 1 GiB, torch 512 MiB per checkpoint, 3 repeats (default)")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--fio-size", default=None, help="bytes per fio run (all jobs together)")
    p.add_argument("--torch-size", default=None, help="bytes per torch checkpoint")
    p.add_argument("--jobs", default="1,4,8")
    p.add_argument("--ckptfs-targets", default=",".join(CKPTFS_TARGETS),
                   help="ckptfs targets to run: ckptfs (default mount: passthrough), "
                        "ckptfs-fuse (--no-passthrough); default both")
    p.add_argument("--fuse-jobs", default=None,
                   help="fio job counts for ckptfs-fuse (a subset of --jobs; default: --jobs)")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--dcp-threads", type=int, default=4)
    p.add_argument("--workloads", default="mlperf,dcp")
    p.add_argument("--sections", default="fio,torch,profile")
    p.add_argument("--touch", default=None, help="memory touched+freed before each run")
    p.add_argument("--workdir", default="/var/tmp")
    p.add_argument("--out", default="bench-results/perf")
    p.add_argument("--no-docs", action="store_true",
                   help="do not write docs/PERFORMANCE.md, docs/bench/perf.json and plots")
    p.add_argument("--keep-tmp", action="store_true")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from benchlib import parse_size

    a = build_parser().parse_args(argv)
    a.quick = bool(a.quick)
    if a.repeats is None:
        a.repeats = 1 if a.quick else 3
    a.fio_size = parse_size(a.fio_size or ("256m" if a.quick else "1g"))
    a.torch_size = parse_size(a.torch_size or ("256m" if a.quick else "512m"))
    a.touch = parse_size(a.touch or ("512m" if a.quick else "1g"))
    a.jobs = [int(x) for x in a.jobs.split(",")]
    a.fuse_jobs = [int(x) for x in a.fuse_jobs.split(",")] if a.fuse_jobs else None
    a.ckptfs_targets = [t for t in a.ckptfs_targets.split(",") if t]
    bad = [t for t in a.ckptfs_targets if t not in CKPTFS_TARGETS]
    if bad:
        raise SystemExit(f"bench_perf.py: unknown ckptfs target(s) {bad}; "
                         f"known: {', '.join(CKPTFS_TARGETS)}")
    a.workloads = [w for w in a.workloads.split(",") if w]
    a.sections = [s for s in a.sections.split(",") if s]
    return a


def _interrupt(signum: int, frame: FrameType | None) -> NoReturn:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if os.geteuid() != 0:
        print("bench_perf.py: needs root (drop_caches, FUSE mounts)", file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    perf = Perf(a)
    code = 0
    try:
        perf.setup()
        if "fio" in a.sections:
            FioBench(perf).run()
        if "torch" in a.sections:
            TorchBench(perf, Peers(perf)).torch_all()
        if "profile" in a.sections:
            perf.progress("profiles (py-spy) ...")
            try:
                Profiles(perf).run()
            except Exception as e:  # noqa: BLE001
                perf.error(f"profiles: {e.__class__.__name__}: {e}")
    except KeyboardInterrupt:
        perf.error("interrupted: partial results")
        code = 130
    except Exception as e:  # noqa: BLE001
        perf.error(f"{e.__class__.__name__}: {e}\n{traceback.format_exc()}")
        code = 1
    finally:
        perf.progress("cleaning up (unmount, stop moto) ...")
        perf.cleanup()
        perf.res["loadavg_end"] = loadavg()
        perf.save()
    import bench_report

    # The write-path overhead on RAM-backed ext4 (scripts/bench_overhead.py, which bench.sh
    # runs first in --full mode): its own section of docs/PERFORMANCE.md, with its commit.
    ov = REPO / "docs" / "bench" / "overhead.json"
    if not a.no_docs and ov.exists():
        perf.res["overhead"] = json.loads(ov.read_text())
    # One big set and many sets (scripts/bench_scale_sets.py --docs, run on its own: ~15 min).
    sc = REPO / "docs" / "bench" / "scale-sets.json"
    if not a.no_docs and sc.exists():
        perf.res["scale"] = json.loads(sc.read_text())
    # History and directory size (scripts/bench_scale.py --docs, run on its own: ~10 min).
    sh = REPO / "docs" / "bench" / "scale.json"
    if not a.no_docs and sh.exists():
        perf.res["scale_history"] = json.loads(sh.read_text())
    bench_report.write_all(perf.res, perf.out, None if a.no_docs else REPO / "docs")
    perf.progress(f"done: {perf.out / 'results.md'}"
                  + ("" if a.no_docs else ", docs/PERFORMANCE.md, docs/bench/perf.json"))
    return code


if __name__ == "__main__":
    sys.exit(main())
