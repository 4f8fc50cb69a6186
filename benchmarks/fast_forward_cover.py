"""Which plans the steady-state fast-forward covers, and what it saves: each row simulated as
`paratwin simulate` runs it (fold=auto, fast_forward=true) and with fast-forward off (still
folded), on Llama 3 8B over 4 DGX H100 nodes, micro-batch 1.

    python benchmarks/fast_forward_cover.py [ROW ...]

Prints per row: micro-batches per pipeline (m), the period (d micro-batches), the
micro-batches the fast-forwarded run simulated (or "-" where it was simulated whole), both
wall times and the relative difference of the two step times (exact: float rounding only).
Asserts nothing; the wall times are one run's (this host's noise is +-20%). Rows: the
presets that pipeline micro-batches (1F1B, interleaved, 3D) or accumulate them (DDP, FSDP,
TP + SP), and pipelines with ZeRO-1/2, FSDP, HSDP, CP, recompute and async TP. FSDP under a
pipeline was never fast-forwarded before 57c2460 (the gathered units it keeps from a forward
to a later backward are named by two micro-batches).
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.presets import cli_job  # noqa: E402
from twin.sim.engine import SimOptions  # noqa: E402
from twin.sim.fastforward import period_microbatches  # noqa: E402
from twin.sim.run import simulate  # noqa: E402

BASE = ("model=llama3_8b", "cluster=dgx_h100", "cluster.num_nodes=4", "parallel.micro_batch_size=1")
PP4 = ("parallel.pp=4", "parallel.global_batch_size=256")
ROWS = {
    "1f1b": ("parallel=pp_1f1b", *PP4),
    "1f1b, full recompute": ("parallel=pp_1f1b", *PP4, "parallel.recompute=full"),
    "interleaved": ("parallel=pp_interleaved", *PP4),
    "interleaved, selective": ("parallel=pp_interleaved", *PP4, "parallel.recompute=selective"),
    "3d": ("parallel=3d", "parallel.global_batch_size=256"),
    "3d, compile + async TP": ("parallel=3d", "parallel.global_batch_size=256", "parallel.compile=true",
                               "parallel.async_tp=true"),
    "zero1 + pp": ("parallel=zero1", *PP4),
    "zero2 + pp": ("parallel=zero2", *PP4),
    "fsdp + pp": ("parallel=fsdp", *PP4),
    "fsdp + pp, kept unsharded": ("parallel=fsdp", *PP4, "parallel.fsdp_reshard_after_forward=false",
                                  "parallel.grad_sync=last"),
    "fsdp + tp + pp": ("parallel=fsdp", "parallel.pp=2", "parallel.tp=2", "parallel.sp=true",
                       "parallel.global_batch_size=256"),
    "fsdp + interleaved": ("parallel=fsdp", "parallel.pp=4", "parallel.pp_schedule=interleaved",
                           "parallel.pp_virtual_stages=2", "parallel.global_batch_size=512"),
    "hsdp + pp": ("parallel=hsdp", "parallel.pp=2", "parallel.global_batch_size=256"),
    "cp + pp": ("parallel=cp", "parallel.pp=2", "parallel.global_batch_size=128"),
    "ddp, accumulating": ("parallel=ddp", "parallel.global_batch_size=512"),
    "fsdp, accumulating": ("parallel=fsdp", "parallel.global_batch_size=512"),
    "tp + sp, accumulating": ("parallel=tp_sp", "parallel.global_batch_size=256"),
}


def timed(job, cost, fast_forward: bool) -> tuple[dict, float]:
    t0 = time.perf_counter()
    res = simulate(job, cost, SimOptions(fold="auto", fast_forward=fast_forward), trace="none")
    return res.summary, time.perf_counter() - t0


def main() -> None:
    rows = sys.argv[1:] or list(ROWS)
    print(f"{'row':<28} {'m':>4} {'d':>3} {'mb sim':>6} {'ff s':>6} {'whole s':>7} {'speed-up':>8} "
          f"{'step s':>9} {'step diff':>9}")
    for name in rows:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            job, cost = cli_job(*BASE, *ROWS[name])
            fast, t_fast = timed(job, cost, True)
            whole, t_whole = timed(job, cost, False)
        ff = fast["fast_forward"]
        diff = abs(fast["step_time_s"] - whole["step_time_s"]) / whole["step_time_s"]
        print(f"{name:<28} {job.parallel.num_microbatches:>4} {period_microbatches(job) or '-':>3} "
              f"{ff['simulated_microbatches'] if ff else '-':>6} {t_fast:>6.2f} {t_whole:>7.2f} "
              f"{t_whole / t_fast:>7.1f}x {fast['step_time_s']:>9.4f} {diff:>9.1e}", flush=True)


if __name__ == "__main__":
    main()
