"""How fast the memory calculator answers: in-process and end to end through the CLI.

Run: python benchmarks/bench_inspect.py
Prints the median wall time of inspect_job for a few jobs (the library call) and of the
`paratwin inspect` command (Python start, Hydra composition and printing included).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.presets import dgx_h100, llama3
from twin.spec import ParallelPlan, build_job
from twin.workload.summary import inspect_job

JOBS = [
    ("llama3_8b", 1, ParallelPlan(zero_stage=3)),
    ("llama3_70b", 8, ParallelPlan(zero_stage=3, tp=8)),
    ("llama3_405b", 2048, ParallelPlan(tp=8, pp=16, zero_stage=1, sp=True, global_batch_size=2048,
                                       pp_stage_layers=[7] + [8] * 14 + [7])),
]


def main() -> None:
    print(f"{'job':<14} {'GPUs':>6} {'inspect_job (ms)':>17}")
    for name, nodes, plan in JOBS:
        model, cluster = llama3(name), dgx_h100(nodes)
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            inspect_job(build_job(model, cluster, plan))
            times.append(time.perf_counter() - t0)
        print(f"{name:<14} {nodes * 8:>6} {statistics.median(times) * 1e3:>17.2f}")
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "paratwin.main", "inspect", "model=llama3_70b",
                        "cluster.num_nodes=8", "parallel.tp=8"], check=True,
                       capture_output=True)
        times.append(time.perf_counter() - t0)
    print(f"`paratwin inspect model=llama3_70b cluster.num_nodes=8 parallel.tp=8` end to end: "
          f"median {statistics.median(times):.3f} s over {len(times)} runs")


if __name__ == "__main__":
    main()
