"""Schedule build time: one representative rank per job, built on demand.

Run: python benchmarks/bench_schedule.py
Target (issue 3): one rank of Llama-3 405B on 16,384 GPUs (TP8 PP16 DP128, 1F1B, Llama 3's
7/8 x 14/7 layer split, 16 micro-batches) builds in under 2 s.
"""

from __future__ import annotations

import statistics
import time

from twin.schedule.builder import build_schedule
from twin.spec import ClusterSpec, GPUSpec, ModelSpec, ParallelPlan, build_job

H100 = GPUSpec(name="H100", peak_tflops={"bf16": 989.0}, hbm_GB=80, hbm_bw_GBps=3350)
LLAMA = {
    "llama3_8b": dict(num_layers=32, hidden_size=4096, num_heads=32, ffn_hidden_size=14336),
    "llama3_70b": dict(num_layers=80, hidden_size=8192, num_heads=64, ffn_hidden_size=28672),
    "llama3_405b": dict(num_layers=126, hidden_size=16384, num_heads=128, ffn_hidden_size=53248),
}
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
        model = ModelSpec(name=name, num_kv_heads=8, vocab_size=128256, seq_len=8192,
                          activation="swiglu", **LLAMA[name])
        cluster = ClusterSpec(name="dgx_h100", num_nodes=nodes, gpus_per_node=8, gpu=H100)
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
