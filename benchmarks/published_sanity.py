"""The twin against Korthikanti et al. 2022 (published.md §2), with the presets' defaults.

Run: python benchmarks/published_sanity.py [--quick]   (--quick skips the 530B and 1T rows)
Table 4: time per transformer layer of the 22B model (TP8, b=4, s=2048) forward and backward
for each technique. Table 5: iteration time of the Table 3 configurations with full
recompute and with SP + selective recompute. A100 80GB (dgx_a100 preset), eager attention
(2022 Megatron had no flash attention). Nothing is tuned to these rows.
"""

from __future__ import annotations

import sys
import time

from hydra import compose, initialize_config_dir

from paratwin.config import CONF_DIR, job_from_cfg, register_schemas
from twin.sim.engine import SimOptions
from twin.sim.run import simulate

TABLE4 = [  # technique, overrides, published forward ms, backward ms
    ("baseline, no recompute", ["parallel.recompute=none"], 7.7, 11.9),
    ("sequence parallelism", ["parallel.sp=true"], 7.2, 11.8),
    ("baseline, full recompute", ["parallel.recompute=full"], 7.7, 19.5),
    ("selective recompute", ["parallel.recompute=selective"], 7.7, 13.2),
    ("selective + sequence", ["parallel.recompute=selective", "parallel.sp=true"], 7.2, 13.1),
]
TABLE5 = [  # model, nodes, pp, v, batch, published full-recompute s, SP+selective s
    ("megatron_22b", 1, 1, 1, 4, 1.42, 1.10),
    ("gpt3_175b", 8, 8, 3, 64, 18.13, 13.75),
    ("mt_nlg_530b", 35, 35, 3, 280, 49.05, 37.83),
    ("megatron_1t", 64, 64, 1, 512, 94.42, 71.49),
]


def job_of(model: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="simulate", overrides=[
            f"model={model}", "cluster=dgx_a100", "parallel=tp", "parallel.tp=8",
            "parallel.flash_attention=false", *overrides])
    return job_from_cfg(cfg)


def layer_times(res, layer: int) -> tuple[float, float]:
    """Forward and backward (with recomputation) of one layer, first micro-batch, rank 0."""
    spans = [s for s in res.trace.spans if s.rank == 0 and s.layer == layer and s.mb == 0
             and s.kind not in ("alloc", "free")]
    fwd = [s for s in spans if s.phase == "fwd"]
    bwd = [s for s in spans if s.phase in ("bwd", "recompute")]
    span = lambda xs: (max(s.end_us for s in xs) - min(s.start_us for s in xs)) / 1e3  # noqa: E731
    return span(fwd), span(bwd)


def main() -> None:
    register_schemas()
    quick = "--quick" in sys.argv
    print("Table 4: 22B per-layer times (ms), TP8, b=4, s=2048, A100")
    print(f"{'technique':<26} {'fwd twin':>9} {'paper':>6} {'err':>6}  "
          f"{'bwd twin':>9} {'paper':>6} {'err':>6}")
    for name, ov, f_pub, b_pub in TABLE4:
        job = job_of("megatron_22b", ["parallel.micro_batch_size=4", "parallel.global_batch_size=4",
                                      "parallel.dp=1", "cluster.num_nodes=1", *ov])
        f, b = layer_times(simulate(job), 24)
        print(f"{name:<26} {f:>9.2f} {f_pub:>6.1f} {f / f_pub - 1:>+6.1%}  {b:>9.2f} {b_pub:>6.1f} "
              f"{b / b_pub - 1:>+6.1%}")
    print("\nTable 5: iteration time (s), Table 3 configurations, A100")
    print(f"{'model':<14} {'GPUs':>5} {'full twin':>10} {'paper':>7} {'err':>7}  {'SP+sel twin':>11} "
          f"{'paper':>7} {'err':>7} {'MFU twin':>8} {'wall s':>7}")
    for model, nodes, pp, v, batch, full_pub, sel_pub in TABLE5:
        if quick and nodes > 8:
            continue
        times = []
        t0 = time.perf_counter()
        for ov in (["parallel.recompute=full"],
                   ["parallel.recompute=selective", "parallel.sp=true"]):
            sched = ["parallel.pp_schedule=interleaved", f"parallel.pp_virtual_stages={v}"] if v > 1 \
                else ["parallel.pp_schedule=1f1b"]
            mb = 4 if model == "megatron_22b" else 1
            job = job_of(model, [f"cluster.num_nodes={nodes}", f"parallel.pp={pp}", "parallel.dp=1",
                                 f"parallel.micro_batch_size={mb}",
                                 f"parallel.global_batch_size={batch}", *sched, *ov])
            s = simulate(job, options=SimOptions(fold="tp")).summary
            times.append((s["step_time_s"], s["mfu"]))
        (tf, _), (ts, mfu) = times
        print(f"{model:<14} {nodes * 8:>5} {tf:>10.2f} {full_pub:>7.2f} {tf / full_pub - 1:>+7.1%}  "
              f"{ts:>11.2f} {sel_pub:>7.2f} {ts / sel_pub - 1:>+7.1%} {mfu:>8.1%} "
              f"{time.perf_counter() - t0:>7.1f}")


if __name__ == "__main__":
    main()
