"""Collective sweep across ranks: every IR kind over message sizes and group sizes, nccl-tests' figures.

For each group size g (the first g ranks), kind and size, every member issues the op
with ``executor.collectives.issue`` (the replay's own code path) on a communicator of the
same kind the replay uses (gloo with one worker thread, or NCCL). One repeat: a barrier
of the control group, then each member times issue -> completion (``perf_counter_ns``
around ``work.wait()``; on GPU after ``torch.cuda.synchronize``); the repeat's time is
the slowest member's. Reported: median, p10 and p90 over repeats; algbw = bytes / time
and busbw = algbw * factor (nccl-tests doc/PERFORMANCE.md: all_reduce 2(n-1)/n;
all_gather, reduce_scatter, all_to_all, gather, scatter (n-1)/n; broadcast, reduce,
sendrecv 1). ``bytes`` follows the IR (nccl-tests sizes). ``sendrecv``: each member sends
``bytes`` to the next member and receives from the previous one (a ring), as nccl-tests'
sendrecv does (odd members post the receive first, so NCCL's in-order p2p cannot deadlock).
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from executor.bench.report import COLLECTIVE_COLUMNS, CsvWriter, spread
from executor.collectives import BufferPool, issue
from executor.groups import _gloo
from twin.schedule.ir import Op
from twin.vocab import BENCH_ONLY_KINDS, COLLECTIVE_KINDS, busbw_factor

KINDS = (*COLLECTIVE_KINDS, *BENCH_ONLY_KINDS)


def message_sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """min_bytes, min_bytes * factor, ... up to max_bytes (inclusive)."""
    out, s = [], int(min_bytes)
    while s <= max_bytes:
        out.append(s)
        s *= factor
    return out


def group_sizes(world: int, asked) -> list[int]:
    """Asked sizes, or 2, 4, 8, ... up to the world plus the world itself."""
    if asked:
        return sorted({int(g) for g in asked})
    out, g = [], 2
    while g < world:
        out.append(g)
        g *= 2
    return out + [world]


def _communicator(ctx, group: tuple[int, ...], name: str, timeout_s: float):
    if ctx.backend == "gloo":
        pg = _gloo(ctx.store, f"bench/{name}", group, ctx.rank, datetime.timedelta(seconds=timeout_s),
                   ctx.env.loopback) if ctx.rank in group else None
        return pg
    pg = dist.new_group(list(group), timeout=datetime.timedelta(seconds=timeout_s), backend="nccl")
    return pg._get_backend(ctx.device) if ctx.rank in group else None


def _one(ctx, pg, kind: str, group: tuple[int, ...], nbytes: int, dtype: str,
         pool: BufferPool, timeout: datetime.timedelta) -> float:
    """Seconds this rank spends from issuing the op to its completion."""
    rank = ctx.rank
    cuda = ctx.device.type == "cuda"
    if kind == "sendrecv":
        i = group.index(rank)
        nxt, prv = group[(i + 1) % len(group)], group[(i - 1) % len(group)]
        ops = [Op(name="bench.send", kind="send", stream="p2p", bytes=nbytes, peer=nxt,
                  tag="bench", dtype=dtype),
               Op(name="bench.recv", kind="recv", stream="p2p", bytes=nbytes, peer=prv,
                  tag="bench", dtype=dtype)]
        if i % 2:  # odd members receive first: NCCL runs a communicator's p2p in order
            ops.reverse()
    else:
        ops = [Op(name=f"bench.{kind}", kind=kind, stream="comm", group=group, bytes=nbytes,
                  root=group[0] if kind in ("broadcast", "reduce", "gather", "scatter") else -1,
                  dtype=dtype)]
    if cuda:
        torch.cuda.synchronize(ctx.device)
    t0 = time.perf_counter_ns()
    issued = [issue(pg, op, rank, pool, pair=False) for op in ops]
    for item in issued:
        item.work.wait(timeout)
    if cuda:
        torch.cuda.synchronize(ctx.device)
    t = (time.perf_counter_ns() - t0) / 1e9
    for item in issued:
        pool.give(*item.buffers)
    return t


def bench_task(ctx) -> None:
    """Rank task: the sweep of run.json's settings; rank 0 writes collectives.csv."""
    s = ctx.settings
    world, rank = ctx.world_size, ctx.rank
    timeout_s = float(s["comm_timeout_s"])
    timeout = datetime.timedelta(seconds=timeout_s)
    sizes = message_sizes(s["min_bytes"], s["max_bytes"], s["step_factor"])
    writer = CsvWriter(ctx.run_dir / "collectives.csv", COLLECTIVE_COLUMNS) if rank == 0 else None
    ctx.reporter.set_phase("groups")
    gsizes = group_sizes(world, s.get("group_sizes"))
    comms = {}
    for g in gsizes:
        group = tuple(range(g))
        comms[g] = (_communicator(ctx, group, f"g{g}", timeout_s),
                    _communicator(ctx, group, f"g{g}.p2p", timeout_s))
    ctx.reporter.set_phase("measure", 0)
    step = 0
    for g in gsizes:
        group = tuple(range(g))
        coll, p2p = comms[g]
        for kind in s["collectives"]:
            for nbytes in sizes:
                pool = BufferPool(ctx.device)
                times = []
                for r in range(s["warmup"] + s["repeats"]):
                    ctx.reporter.op(step)
                    step += 1
                    dist.barrier()
                    t = 0.0
                    if rank in group:
                        t = _one(ctx, p2p if kind == "sendrecv" else coll, kind, group, nbytes,
                                 s["dtype"], pool, timeout)
                    slowest = torch.tensor([t], dtype=torch.float64)
                    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                    if r >= s["warmup"]:
                        times.append(float(slowest.item()))
                del pool
                if writer is None:
                    continue
                stats = spread(times)
                algbw = nbytes / stats["time_s_median"] / 1e9
                writer.row({"kind": kind, "group_size": g, "bytes": nbytes, "dtype": s["dtype"],
                            **stats, "algbw_GBps": algbw,
                            "busbw_GBps": algbw * busbw_factor(kind, g), "backend": ctx.backend})
                print(f"{kind:<15} n={g:<3} {nbytes:>11} B {stats['time_s_median'] * 1e6:>11.1f} us "
                      f"algbw {algbw:8.3f} GB/s busbw {algbw * busbw_factor(kind, g):8.3f} GB/s",
                      flush=True)
    dist.barrier()
