"""Twin speed: wall time, events and step time of one simulated step of large jobs.

Run: python benchmarks/bench_twin.py [a|b|c|d|e|f|g ...] [--repeat N]   (default: all, once)
 (a) Llama-3 8B, 8 GPUs (one DGX H100), FSDP
 (b) Llama-3 70B, 1,024 GPUs, TP8 PP4 DP32, 1F1B, 8 micro-batches, every rank simulated
     (fold=none, no fast-forward: the engine's own speed)
 (c) Llama-3 405B, 16,384 GPUs, TP8 PP16 DP128, 1F1B, Llama 3's 7/8x14/7 layer split,
     16 micro-batches per pipeline
 (d) Megatron 39.1B (Narayanan et al. 2021, Table 1) on 512 A100s: TP8 PP2 DP32, global
     batch 1536 (48 micro-batches per pipeline), micro-batch 1, interleaved 1F1B (v=2),
     full recompute
 (e) Megatron 1T on 3,072 A100s: TP8 PP64 DP6, global batch 3072 (512 micro-batches per
     pipeline), micro-batch 1, interleaved (v=2), full recompute
 (f) Llama-3 405B as (c) with 128 micro-batches per pipeline (global batch 16,384)
 (g) DeepSeek-V3 on 1,024 H100s: PP8 (7/8x6/6 layers), EP32 inside DP128 (edp 4), ZeRO-1,
     full recompute, 32 micro-batches per pipeline (uniform routing: every EP rank folds)
(c)-(g) run as `paratwin simulate` does by default: fold=auto (every exact copy simulated
once), fast_forward=true, trace=auto (what the report draws); "write s" is writing that
trace (spans.json), "report s" what the CLI writes next from it (report.html and the Chrome
export trace.json). (d) and (e) use the cluster's profile (calibration=auto: dgx_a100, fitted
on measured A100 steps, whose host waits after each send/recv batch as Megatron's does).
Target: each step under 10 s on 2 cores. Prints
figures, asserts nothing. This host's speed drifts by 10-20% between spells of the same day,
more between days (row (e) at the same code: medians of five runs 8.0-9.8 s, single runs up to
12 s): read a wall as a median of --repeat 5, and compare two trees in the same spell, or by
benchmarks/instructions.py, which the drift does not move.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.presets import cli_job, dgx_h100, llama3  # noqa: E402
from twin.cost import CostModel  # noqa: E402
from twin.files import write_json_atomic  # noqa: E402
from twin.report import write_report  # noqa: E402
from twin.sim.engine import SimOptions  # noqa: E402
from twin.sim.run import simulate  # noqa: E402
from twin.spec import Job, ParallelPlan, build_job  # noqa: E402

SPLIT_405B = [7] + [8] * 14 + [7]
JOBS = {  # Llama 3 on DGX H100s (benchmarks/presets.py): model, nodes, plan, fold
    "a": ("llama3_8b", 1, ParallelPlan(zero_stage=3), "none"),
    "b": ("llama3_70b", 128, ParallelPlan(tp=8, pp=4, global_batch_size=256), "none"),
    "c": ("llama3_405b", 2048, ParallelPlan(tp=8, pp=16, zero_stage=1, sp=True,
                                            global_batch_size=2048,
                                            pp_stage_layers=SPLIT_405B), "auto"),
    "f": ("llama3_405b", 2048, ParallelPlan(tp=8, pp=16, zero_stage=1, sp=True,
                                            global_batch_size=16384,
                                            pp_stage_layers=SPLIT_405B), "auto"),
}
MEGATRON = ("cluster=dgx_a100", "parallel=pp_interleaved", "parallel.tp=8",
            "parallel.micro_batch_size=1", "parallel.recompute=full")
PUBLISHED = {  # Narayanan et al. 2021 Table 1 rows (and (g)), as `paratwin simulate OVERRIDES`
    "d": ("model=megatron_39b", "cluster.num_nodes=64", "parallel.pp=2",
          "parallel.global_batch_size=1536", *MEGATRON),
    "e": ("model=megatron_1t", "cluster.num_nodes=384", "parallel.pp=64",
          "parallel.global_batch_size=3072", *MEGATRON),
    "g": ("model=deepseek_v3", "cluster=dgx_h100", "cluster.num_nodes=128", "parallel=zero1",
          "parallel.pp=8", "parallel.pp_stage_layers=[7,8,8,8,8,8,8,6]", "parallel.ep=32",
          "parallel.global_batch_size=4096", "parallel.recompute=full"),
}


def job_of(key: str) -> tuple[str, Job, CostModel | None, SimOptions, str | None]:
    """(model name, job, profile, options, trace level) of one row; (a) and (b) measure the
    engine itself (every rank and micro-batch simulated), the others run as the CLI does."""
    if key in PUBLISHED:
        job, cost = cli_job(*PUBLISHED[key])
        return job.model.name, job, cost, SimOptions(fold="auto"), "auto"
    name, nodes, plan, fold = JOBS[key]
    job = build_job(llama3(name), dgx_h100(nodes), plan)
    if fold == "none":
        return name, job, None, SimOptions(fold="none", fast_forward=False), None
    return name, job, None, SimOptions(fold=fold), "auto"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rows", nargs="*", help="rows to run (default: all)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="simulate each row this many times; its wall is the median (this "
                         "host's noise is +-20%%), the spread printed below it")
    args = ap.parse_args()
    which = args.rows or sorted([*JOBS, *PUBLISHED])
    print(f"{'job':<4} {'model':<13} {'GPUs':>6} {'m':>4} {'fold':<5} {'sim':>4} "
          f"{'mb sim':>6} {'ops':>10} {'events':>9} {'wall s':>7} {'write s':>7} "
          f"{'report s':>8} {'step s':>8} {'MFU':>6}")
    for key in which:
        name, job, cost, options, trace = job_of(key)
        walls = []
        for _ in range(max(1, args.repeat)):
            res = None  # the last run's result freed before the next is timed
            t0 = time.perf_counter()
            res = simulate(job, cost, options, trace=trace)
            walls.append(time.perf_counter() - t0)
        wall = statistics.median(walls)
        report = "-"
        with tempfile.TemporaryDirectory() as tmp:
            t1 = time.perf_counter()
            res.trace.save(Path(tmp) / "spans.json")
            write = time.perf_counter() - t1
            if trace is not None:  # what `paratwin simulate` writes next, from the same trace
                write_json_atomic(Path(tmp) / "summary.json", res.summary.to_dict())
                t2 = time.perf_counter()
                write_report([tmp], traces={Path(tmp): res.trace.as_saved()})
                report = f"{time.perf_counter() - t2:.2f}"
        s = res.summary
        ff = s["fast_forward"]
        m = job.parallel.num_microbatches
        print(f"({key})  {name:<13} {job.grid.world_size:>6} {m:>4} {s['fold']:<5} "
              f"{s['simulated_ranks']:>4} {ff['simulated_microbatches'] if ff else m:>6} "
              f"{s['ops']:>10,} {s['events']:>9,} {wall:>7.2f} {write:>7.2f} {report:>8} "
              f"{s['step_time_s']:>8.3f} {s['mfu']:>6.1%}", flush=True)
        if len(walls) > 1:
            print(f"     wall over {len(walls)} runs: median {wall:.2f} s, min {min(walls):.2f}, "
                  f"max {max(walls):.2f} ({' '.join(f'{w:.2f}' for w in walls)})", flush=True)


if __name__ == "__main__":
    main()
