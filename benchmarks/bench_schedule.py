"""Schedule build time: one representative rank per job, built on demand.

Run: python benchmarks/bench_schedule.py
Target (issue 3): one rank of Llama-3 405B on 16,384 GPUs (TP8 PP16 DP128, 1F1B, Llama 3's
7/8 x 14/7 layer split, 16 micro-batches) builds in under 2 s.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from twin.schedule.builder import build_schedule

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.presets import dgx_h100, llama3
from twin.spec import ParallelPlan, build_job

JOBS = [
    ("llama3_8b", 1, ParallelPlan(zero_stage=3), "FSDP, 8 GPUs"),
    ("llama3_70b", 128, ParallelPlan(tp=8, pp=4, global_batch_size=256), "TP8 PP4 DP32"),
    ("llama3_405b", 2048, ParallelPlan(tp=8, pp=16, zero_stage=1, sp=True, global_batch_size=2048,
                                       pp_stage_layers=[7] + [8] * 14 + [7]),
     "TP8 PP16 DP128 1F1B"),
]


def main() -> None:
    print(f"{'job':<12} {'GPUs':>6} {'plan':<22} {'rank':>6} {'ops':>7} {'build (ms)':>11}")
    for name, nodes, plan, desc in JOBS:
        model, cluster = llama3(name), dgx_h100(nodes)
        job = build_job(model, cluster, plan)
        rank = job.grid.rank(pp=job.parallel.pp // 2, dp=job.parallel.dp - 1, tp=job.parallel.tp - 1)
        times, n = [], 0
        for _ in range(5):
            t0 = time.perf_counter()
            n = len(build_schedule(job).program(rank).ops)
            times.append(time.perf_counter() - t0)
        print(f"{name:<12} {job.grid.world_size:>6} {desc:<22} {rank:>6} {n:>7} "
              f"{statistics.median(times) * 1e3:>11.1f}")


if __name__ == "__main__":
    main()
