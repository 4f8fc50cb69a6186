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

from twin.spec import ClusterSpec, GPUSpec, ModelSpec, ParallelPlan, build_job
from twin.workload.summary import inspect_job

H100 = GPUSpec(name="H100", peak_tflops={"bf16": 989.0}, hbm_GB=80, hbm_bw_GBps=3350)
LLAMA = {
    "llama3_8b": dict(num_layers=32, hidden_size=4096, num_heads=32, ffn_hidden_size=14336),
    "llama3_70b": dict(num_layers=80, hidden_size=8192, num_heads=64, ffn_hidden_size=28672),
    "llama3_405b": dict(num_layers=126, hidden_size=16384, num_heads=128, ffn_hidden_size=53248),
}
JOBS = [
    ("llama3_8b", 1, ParallelPlan(zero_stage=3)),
    ("llama3_70b", 8, ParallelPlan(zero_stage=3, tp=8)),
    ("llama3_405b", 2048, ParallelPlan(tp=8, pp=16, zero_stage=1, sp=True, global_batch_size=2048,
                                       pp_stage_layers=[7] + [8] * 14 + [7])),
]


def main() -> None:
    print(f"{'job':<14} {'GPUs':>6} {'inspect_job (ms)':>17}")
    for name, nodes, plan in JOBS:
        model = ModelSpec(name=name, num_kv_heads=8, vocab_size=128256, seq_len=8192,
                          activation="swiglu", **LLAMA[name])
        cluster = ClusterSpec(name="dgx_h100", num_nodes=nodes, gpus_per_node=8, gpu=H100)
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            inspect_job(build_job(model, cluster, plan))
            times.append(time.perf_counter() - t0)
        print(f"{name:<14} {nodes * 8:>6} {statistics.median(times) * 1e3:>17.2f}")
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "twin.cli.main", "inspect", "model=llama3_70b",
                        "cluster.num_nodes=8", "parallel.tp=8"], check=True,
                       capture_output=True)
        times.append(time.perf_counter() - t0)
    print(f"`paratwin inspect model=llama3_70b cluster.num_nodes=8 parallel.tp=8` end to end: "
          f"median {statistics.median(times):.3f} s over {len(times)} runs")


if __name__ == "__main__":
    main()
