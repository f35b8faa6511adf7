"""The fio section of scripts/bench_perf.py: scripts/fio/{write,read_warm,read_cold}.fio at
each job count, through a mount of each ckptfs target and on the raw cache disk, back to back
(order rotated per repeat and job count).
"""

from __future__ import annotations

from benchlib import MiB, loadavg, main_thread_cpu_s
from perf_core import Json, Perf, drop_caches, io_delta, tsfx


class FioBench:
    def __init__(self, perf: Perf) -> None:
        self.p = perf

    def run(self) -> None:
        from bench_fio import check_files, clean_dir, run_fio

        a = self.p.a
        cts = a.ckptfs_targets
        self.raw_fio = self.p.raw / "fio"
        self.raw_fio.mkdir(exist_ok=True)
        jobfile_out = self.p.out / "last-fio.json"
        n = a.repeats * sum(1 + sum(nj in self.p.fio_jobs(t) for t in cts) for nj in a.jobs) * 3
        k = 0
        for rep in range(a.repeats):
            mounts: Json = {}
            through = dict.fromkeys(cts, 0)
            try:
                for t in cts:
                    mounts[t] = self.p.new_ckptfs(f"fio{rep}{tsfx(t)}", f"fio{rep}{tsfx(t)}", t)
                for ji, nj in enumerate(a.jobs):
                    per_job = (a.fio_size // nj) // MiB * MiB
                    tl = ["raw"] + [t for t in cts if nj in self.p.fio_jobs(t)]
                    rot = (rep + ji) % len(tl)
                    order = tl[rot:] + tl[:rot]
                    for phase in ("write", "read-warm", "read-cold"):
                        for target in order:
                            m = mounts.get(target)
                            d = self.raw_fio if m is None else m.mnt
                            if phase == "write":
                                clean_dir(d)
                                if m is not None:
                                    m.wait_idle(600)
                            st0 = m.status() if m is not None else None
                            if phase == "read-cold":
                                drop_caches()
                            self.p.hygiene()
                            la0 = loadavg()
                            cpu0 = m.cpu_s() if m is not None else None
                            mcpu0 = main_thread_cpu_s(m.pid) if m is not None else None
                            rec = run_fio(phase, d, per_job, nj, jobfile_out,
                                          timeout=120 + a.fio_size / 10e6)
                            rec.update(rep=rep, numjobs=nj, phase=phase, target=target,
                                       loadavg=[la0, loadavg()])
                            if m is not None:
                                # main thread first, then all: its delta never exceeds the total
                                mcpu1 = main_thread_cpu_s(m.pid)
                                rec["daemon_cpu_s"] = round(m.cpu_s() - cpu0, 3)
                                if mcpu0 is not None and mcpu1 is not None:
                                    rec["daemon_main_thread_cpu_s"] = round(mcpu1 - mcpu0, 3)
                                rec.update(io_delta(st0, m.status()))
                                through[target] += (rec.get("io_bytes", 0)
                                                    if phase == "write" else 0)
                            if phase == "write" and "error" not in rec:
                                bad = check_files(d, per_job, nj)
                                if bad:
                                    rec["error"] = bad
                            if phase == "write" and m is not None:
                                drain, _ = m.wait_idle(600)
                                rec["upload_drain_s"] = round(drain, 2)
                            self.p.res["fio"].append(rec)
                            k += 1
                            if "error" in rec:
                                self.p.error(f"fio {phase} nj={nj} {target}: {rec['error']}")
                            served = ""
                            if m is not None:
                                b = rec.get("daemon_bytes_written" if phase == "write"
                                            else "daemon_bytes_read")
                                served = (f"  daemon served {b / MiB:.0f} MiB, "
                                          f"{rec.get('passthrough_opens', 0)} pt opens"
                                          if b is not None else "")
                            self.p.progress(f"fio {k}/{n}: rep {rep + 1} {phase:9s} nj={nj} "
                                          f"{target:11s} {rec.get('mbps', 0):7.0f} MB/s"
                                          f"  load {la0[0]:.1f}{served}")
                            self.p.save()
                    clean_dir(self.raw_fio)
                    for m in mounts.values():
                        m.wait_idle(600)
                        clean_dir(m.mnt)
                    for m in mounts.values():
                        m.wait_idle(600)
            finally:
                for t, m in mounts.items():
                    self.p.close_ckptfs(m, through[t])

