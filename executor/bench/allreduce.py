"""Replayed all-reduce against a bare torch.distributed loop, in the same run: the replay's overhead.

Per message size and round, every rank first times a bare loop (``dist.all_reduce`` on a
``dist.new_group`` with torch's defaults, a barrier before each call) and then replays a
schedule whose program is ``ops_per_step`` back-to-back all-reduces of that size on the
``comm`` stream (the replay's own communicators, issue, completion callbacks and FIFO
start times). A repeat's time is the slowest rank's; busbw = bytes / time * 2(n-1)/n
(nccl-tests doc/PERFORMANCE.md). Rank 0 writes replay_vs_bare.json.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from executor.bench.report import spread
from executor.groups import build_comms
from executor.replay import Replayer
from twin.rundir import write_json
from twin.schedule.ir import Op, Program
from twin.vocab import busbw_factor


def _slowest(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def compare_task(ctx) -> None:
    s = ctx.settings
    world, rank, device = ctx.world_size, ctx.rank, ctx.device
    group = tuple(range(world))
    cuda = device.type == "cuda"
    bare_pg = dist.new_group(list(group), backend=ctx.backend)
    factor = busbw_factor("all_reduce", world)
    rows = []
    ctx.reporter.set_phase("measure", 0)
    for n_size, nbytes in enumerate(s["sizes"]):
        buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        ops = [Op(name=f"ar{k}", kind="all_reduce", stream="comm", group=group, bytes=nbytes,
                  dtype="fp32", deps=(k - 1,) if k and s.get("chain") else ())
               for k in range(s["ops_per_step"])]
        programs = {r: Program(r, list(ops)) for r in range(world)}
        comms = build_comms(programs, rank, world, ctx.store, ctx.backend,
                            float(s["comm_timeout_s"]), loopback=ctx.env.loopback,
                            prefix=f"compare{n_size}")
        cls = Replayer
        if cuda:
            from executor.replay_cuda import CudaReplayer

            cls = CudaReplayer
        replayer = cls(programs[rank], comms, device, reporter=ctx.reporter,
                       wait_timeout_s=float(s["comm_timeout_s"]))
        bare, replay = [], []
        step = 0
        for _ in range(s["rounds"]):
            times = []
            for r in range(s["warmup"] + s["repeats"]):
                ctx.reporter.op(r)
                dist.barrier()
                t0 = time.perf_counter_ns()
                dist.all_reduce(buf, group=bare_pg)
                if cuda:
                    torch.cuda.synchronize(device)
                if r >= s["warmup"]:
                    times.append((time.perf_counter_ns() - t0) / 1e9)
            bare += _slowest(times)
            times = []
            for r in range(s["warmup"] + s["repeats"]):
                dist.barrier()
                result = replayer.run_step(step)
                step += 1
                if r >= s["warmup"]:
                    times += [(end - start) / 1e9 for start, end in result.times]
            replay += _slowest(times)
        b, p = spread(bare), spread(replay)
        row = {"bytes": nbytes, "world_size": world, "backend": ctx.backend,
               "bare_time_s": b["time_s_median"], "replay_time_s": p["time_s_median"],
               "bare_busbw_GBps": nbytes / b["time_s_median"] / 1e9 * factor,
               "replay_busbw_GBps": nbytes / p["time_s_median"] / 1e9 * factor,
               "bare_samples": len(bare), "replay_samples": len(replay)}
        row["ratio"] = row["replay_busbw_GBps"] / row["bare_busbw_GBps"]
        rows.append(row)
        if rank == 0:
            write_json(ctx.run_dir / "replay_vs_bare.json", rows)
        del buf, replayer, comms
    dist.barrier()
