"""The checkpoints of scripts/bench_perf.py's torch workloads: the MLPerf-like rank processes
(spawned: this module is re-imported there) with their shards, the GPT-like DCP state dict, and
a checkpoint saved into / loaded from a directory (the file-system targets).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

from benchlib import BenchError
from perf_core import dir_bytes

# a state dict (tensors by name, nested)
StateDict = dict[str, Any]

def _rank_state(rank: int, nbytes: int):
    """One MLPerf-like rank shard: fp16 model (2 B/param) + fp32 optimizer state (master
    weights, exp_avg, exp_avg_sq: 12 B/param) = 14 B/param, in tensors of <= 32M params."""
    import torch

    g = torch.Generator().manual_seed(1234 + rank)
    params = nbytes // 14
    model, optim = {}, {}
    i = 0
    left = params
    while left > 0:
        n = min(left, 32 << 20)
        w = torch.randn(n, generator=g)
        model[f"layer{i}.weight"] = w.to(torch.float16)
        optim[f"layer{i}"] = {"master": w, "exp_avg": torch.randn(n, generator=g),
                              "exp_avg_sq": torch.rand(n, generator=g)}
        left -= n
        i += 1
    return {"rank": rank, "model": model, "optimizer": optim, "step": 100}


def _rank_main(rank: int, nbytes: int, conn) -> None:
    import torch

    torch.set_num_threads(1)
    state = _rank_state(rank, nbytes)
    conn.send(("ready", None))
    while True:
        cmd, path = conn.recv()
        if cmd == "exit":
            return
        try:
            t0 = time.perf_counter()
            if cmd == "save":
                torch.save(state, path)
                fd = os.open(path, os.O_RDONLY)  # MLPerf: fsync at the end of the checkpoint
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
                n = os.path.getsize(path)
            elif cmd == "load":
                sd = torch.load(path, map_location="cpu", weights_only=True)
                n = sum(t.numel() * t.element_size() for t in sd["model"].values())
                n += sum(t.numel() * t.element_size() for o in sd["optimizer"].values()
                         for t in o.values())
                del sd
            else:
                raise ValueError(cmd)
            conn.send(("ok", (time.perf_counter() - t0, n)))
        except Exception as e:  # noqa: BLE001
            conn.send(("error", f"{e.__class__.__name__}: {e}"))


class Ranks:
    """R rank processes, each holding its shard; save/load run in all of them at once."""

    def __init__(self, n: int, total: int) -> None:
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for r in range(n):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_rank_main, args=(r, total // n, b), daemon=True)
            p.start()
            self.conns.append(a)
            self.procs.append(p)
        for c in self.conns:
            if c.recv()[0] != "ready":
                raise BenchError("rank process failed to start")

    def run(self, cmd: str, paths: list[str]) -> tuple[float, int]:
        t0 = time.perf_counter()
        for c, p in zip(self.conns, paths):
            c.send((cmd, p))
        total, errors = 0, []
        for c in self.conns:
            st, val = c.recv()
            if st == "ok":
                total += val[1]
            else:
                errors.append(val)
        secs = time.perf_counter() - t0
        if errors:
            raise BenchError(f"rank {cmd} failed: {errors[0]}")
        return secs, total

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(("exit", None))
            except OSError:
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()  # our own child process, by handle


def gpt_state_dict(nbytes: int):
    """A GPT-like fp32 state dict of about `nbytes`: token + position embeddings, blocks of
    (ln, qkv, proj, mlp up/down), final ln."""
    import torch

    d, vocab, ctx = 1024, 32000, 2048
    g = torch.Generator().manual_seed(7)
    sd = {"tok_emb.weight": torch.randn(vocab, d, generator=g),
          "pos_emb.weight": torch.randn(ctx, d, generator=g)}
    per_block = (3 * d * d + d * d + 8 * d * d + 4 * d) * 4
    nblocks = max(1, (nbytes - (vocab + ctx) * d * 4) // per_block)
    for i in range(nblocks):
        p = f"blocks.{i}."
        sd[p + "ln1.weight"] = torch.ones(d)
        sd[p + "attn.qkv.weight"] = torch.randn(3 * d, d, generator=g) * 0.02
        sd[p + "attn.proj.weight"] = torch.randn(d, d, generator=g) * 0.02
        sd[p + "ln2.weight"] = torch.ones(d)
        sd[p + "mlp.up.weight"] = torch.randn(4 * d, d, generator=g) * 0.02
        sd[p + "mlp.down.weight"] = torch.randn(d, 4 * d, generator=g) * 0.02
        sd[p + "mlp.up.bias"] = torch.randn(4 * d, generator=g)
    sd["ln_f.weight"] = torch.ones(d)
    return {"model": sd}



# save/load through a directory, for the file-system targets

def fs_save(wl: str, d: Path, ranks: Ranks | None, sd: StateDict | None, dcp_threads: int
            ) -> tuple[float, int]:
    """Save one checkpoint into the directory `d` (must not exist). Returns (s, bytes)."""
    if wl == "mlperf":
        assert ranks is not None  # mlperf runs in the rank processes
        tmp = d.with_name(d.name + ".tmp")
        tmp.mkdir(parents=True)
        t0 = time.perf_counter()
        _, _n = ranks.run("save", [str(tmp / f"rank{r}.pt") for r in range(len(ranks.conns))])
        os.rename(tmp, d)
        return time.perf_counter() - t0, sum(dir_bytes(d).values())
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    d.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    dcp.save(sd, storage_writer=FileSystemWriter(str(d), thread_count=dcp_threads,
                                                 sync_files=True))
    return time.perf_counter() - t0, sum(dir_bytes(d).values())

def fs_load(wl: str, d: Path, ranks: Ranks | None, sd_out: StateDict | None) -> float:
    if wl == "mlperf":
        assert ranks is not None  # mlperf runs in the rank processes
        secs, _ = ranks.run("load", [str(d / f"rank{r}.pt") for r in range(len(ranks.conns))])
        return secs
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    t0 = time.perf_counter()
    dcp.load(sd_out, storage_reader=FileSystemReader(str(d)))
    return time.perf_counter() - t0

