"""Interference on one host: how much ranks sharing cores, and communication running beside
compute, slow a GEMM (the calibration of the twin's shared cores and overlap slowdown).

Three phases, each timing ``repeats`` GEMMs of n x n x n per rank (perf_counter_ns),
repeated over ``cycles`` interleaved cycles (medians):
alone (rank 0 computes, the others wait in a barrier), concurrent (every rank computes
at once), and overlap (every rank computes while asynchronous all-reduces of
``comm_bytes`` run on the same ranks). Rank 0 writes interference.json with the medians.
"""

from __future__ import annotations

import datetime
import statistics
import time

import torch
import torch.distributed as dist

from twin.rundir import write_json


def _gemms(a: torch.Tensor, b: torch.Tensor, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        torch.mm(a, b)
        out.append((time.perf_counter_ns() - t0) / 1e9)
    return out


def _max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def interference_task(ctx) -> None:
    s = ctx.settings
    n, repeats = int(s["gemm_n"]), int(s["repeats"])
    rank = ctx.rank
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    _gemms(a, b, 3)  # warm-up
    ctx.reporter.set_phase("measure", 0)
    comm_pg = dist.new_group(list(range(ctx.world_size)), backend="gloo")
    buf = torch.ones(int(s["comm_bytes"]) // 4)
    timeout = datetime.timedelta(seconds=float(s["comm_timeout_s"]))
    alone, conc, over = [], [], []
    for cycle in range(int(s.get("cycles", 3))):  # interleaved, medians: the host's noise drifts
        ctx.reporter.op(3 * cycle)
        dist.barrier()
        t = statistics.median(_gemms(a, b, repeats)) if rank == 0 else 0.0
        dist.barrier()
        alone.append(_max_over_ranks(t))
        ctx.reporter.op(3 * cycle + 1)
        dist.barrier()
        conc.append(_max_over_ranks(statistics.median(_gemms(a, b, repeats))))
        ctx.reporter.op(3 * cycle + 2)
        dist.barrier()
        works = [dist.all_reduce(buf, group=comm_pg, async_op=True)
                 for _ in range(int(s["comm_ops"]))]
        t = statistics.median(_gemms(a, b, repeats))
        for w in works:
            w.wait(timeout=timeout)
        over.append(_max_over_ranks(t))
    alone, conc, over = (statistics.median(x) for x in (alone, conc, over))
    if rank == 0:
        write_json(ctx.run_dir / "interference.json", {
            "gemm_n": n, "repeats": repeats, "world_size": ctx.world_size,
            "gemm_alone_s": alone, "gemm_concurrent_s": conc, "gemm_overlap_s": over,
            "comm_bytes": int(s["comm_bytes"]), "comm_ops": int(s["comm_ops"])})
