"""Twin speed: simulated events per second and wall time of the issue's three jobs.

Run: python benchmarks/bench_twin.py [a|b|c ...]   (default: all three)
 (a) Llama-3 8B, 8 GPUs (one DGX H100), FSDP
 (b) Llama-3 70B, 1,024 GPUs, TP8 PP4 DP32, 1F1B, 8 micro-batches, unfolded
 (c) Llama-3 405B, 16,384 GPUs, TP8 PP16 DP128, 1F1B, Llama 3's 7/8x14/7 layer split,
     16 micro-batches, folded along dp and tp
Targets on a 2-core machine: (c) under 5 s, (b) under 60 s. Prints figures, asserts nothing.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from twin.sim.engine import SimOptions
from twin.sim.run import simulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.presets import dgx_h100, llama3
from twin.spec import ParallelPlan, build_job

JOBS = {
    "a": ("llama3_8b", 1, ParallelPlan(zero_stage=3), "none"),
    "b": ("llama3_70b", 128, ParallelPlan(tp=8, pp=4, global_batch_size=256), "none"),
    "c": ("llama3_405b", 2048, ParallelPlan(tp=8, pp=16, zero_stage=1, sp=True,
                                            global_batch_size=2048,
                                            pp_stage_layers=[7] + [8] * 14 + [7]), "all"),
}


def main() -> None:
    which = sys.argv[1:] or list(JOBS)
    print(f"{'job':<4} {'model':<12} {'GPUs':>6} {'fold':<5} {'sim ranks':>9} {'ops':>10} "
          f"{'events':>10} {'wall s':>7} {'events/s':>9} {'step s':>8} {'MFU':>6}")
    for key in which:
        name, nodes, plan, fold = JOBS[key]
        job = build_job(llama3(name), dgx_h100(nodes), plan)
        t0 = time.perf_counter()
        s = simulate(job, options=SimOptions(fold=fold)).summary
        wall = time.perf_counter() - t0
        print(f"({key})  {name:<12} {job.grid.world_size:>6} {fold:<5} {s['simulated_ranks']:>9} "
              f"{s['ops']:>10,} {s['events']:>10,} {wall:>7.2f} {s['events'] / wall:>9,.0f} "
              f"{s['step_time_s']:>8.3f} {s['mfu']:>6.1%}")


if __name__ == "__main__":
    main()
