"""Long context and modern pipelines against torchtitan's published H100 runs.

Run: python benchmarks/long_context.py [--jobs N] [--only SECTION ...] [--json FILE]

Every row is `paratwin simulate` (calibration=auto: the dgx_h100 profile, derived from
published H100 kernel and NCCL figures; fold=auto) of a configuration torchtitan published
in benchmarks/llama3_h100_202412_torchtitan.md (pytorch/torchtitan, Dec 2024: Llama 3.1,
H100 SXM 96 GB HBM2e at 2.4 TB/s and 500 W, 400 Gb/s per GPU), with its TPS/GPU (tokens per
second per GPU) and peak memory beside the twin's. Their GPUs differ from the dgx_h100
preset (80 GB HBM3 at 3.35 TB/s, 700 W), so the rows measure how far the twin's mechanisms
carry, not a fit. Sections:

- table1: Llama 3.1 8B on 8 GPUs, FSDP, eager / torch.compile / compile + FP8 (Table 1), with
  torchtitan's selective checkpointing as its llama3_8b.toml sets it (selective_ac_option
  'op': recompute=op);
- cp8b:   Llama 3.1 8B on 8 GPUs, FSDP x CP = 8 at 32K-262K tokens, compile + FP8 (Table 2);
- tp70b:  Llama 3.1 70B on 256 GPUs, FSDP 32 x TP 8, compile + FP8, async TP off / on (Table 4);
- pp405b: Llama 3.1 405B on 512 GPUs, FSDP 8 x TP 8 x PP 8, 1F1B / interleaved, 8 micro-batches
  of 4 (Table 5);
- cp405b: Llama 3.1 405B on 512 GPUs, TP 8 x PP 8, FSDP x CP = 8 at 32K-262K (Table 6);
- sched70b: Llama 3 70B on 64 and 128 GPUs (TP 8 x PP 4 or 8, 16 or 32 micro-batches),
  1F1B / interleaved / ZB-V / DualPipeV with async TP off and on (no published figures: the
  twin's what-if).

Prints figures, asserts nothing. Takes minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# torchtitan 9dec370 (Dec 2024) compiled each transformer block, not the loss
COMPILE = ("parallel.compile=true", "parallel.compile_loss=false")
FAST = (*COMPILE, "parallel.float8=tensorwise")
B8 = ("model=llama3_8b", "cluster=dgx_h100", "cluster.num_nodes=1", "parallel=fsdp")
B70 = ("model=llama3_70b", "cluster=dgx_h100", "parallel.tp=8", "parallel.sp=true")
B405 = ("model=llama3_405b", "cluster=dgx_h100", "cluster.num_nodes=64", "parallel.tp=8",
        "parallel.sp=true", "parallel.pp=8", "parallel.zero_stage=3", "parallel.recompute=full",
        *FAST, "parallel.async_tp=true",
        # torchtitan under PP: FSDP keeps parameters gathered after forward and reduces the
        # gradients on the last micro-batch only (pipelining's backward_maybe_with_nosync)
        "parallel.fsdp_reshard_after_forward=false", "parallel.grad_sync=last")
MB4 = ("parallel.global_batch_size=256", "parallel.micro_batch_size=4")
SPLIT8 = "parallel.pp_stage_layers=[15,16,16,16,16,16,16,15]"
SPLIT16 = "parallel.pp_stage_layers=[7,8,8,8,8,8,8,8,8,8,8,8,8,8,8,7]"


def _cp(seq: int, cp: int, *base: str, per_rank: int = 1) -> tuple[str, ...]:
    return (*base, f"model.seq_len={seq}", f"parallel.cp={cp}", "parallel.cp_method=ring",
            "parallel.cp_load_balance=headtail", f"parallel.global_batch_size={per_rank * 8 // cp}")


ROWS = {  # section: [(label, published TPS/GPU, published GiB, overrides)]
    "table1": [
        ("FSDP (eager)", 5762, 82.4, (*B8, "parallel.global_batch_size=16",
                                      "parallel.micro_batch_size=2", "parallel.recompute=op")),
        ("FSDP + compile", 6667, 77.0, (*B8, "parallel.global_batch_size=16",
                                        "parallel.micro_batch_size=2", "parallel.recompute=op",
                                        *COMPILE)),
        ("FSDP + compile + FP8", 8532, 76.8, (*B8, "parallel.global_batch_size=16",
                                              "parallel.micro_batch_size=2",
                                              "parallel.recompute=op", *FAST)),
    ],
    "cp8b": [(f"FSDP {8 // cp}, CP {cp}, {seq // 1024}K", tps, mem,
              _cp(seq, cp, *B8, "parallel.recompute=full", *FAST))
             for cp, seq, tps, mem in ((1, 32768, 3890, 83.9), (2, 65536, 2540, 84.2),
                                       (4, 131072, 1071, 84.0), (8, 262144, 548, 84.5))],
    "tp70b": [(f"FSDP 32 x TP 8{label}", tps, mem,
               (*B70, "cluster.num_nodes=32", "parallel.zero_stage=3", "parallel.recompute=full",
                "parallel.micro_batch_size=16", "parallel.global_batch_size=512", *FAST, *extra))
              for label, tps, mem, extra in ((" (2D)", 829, 71.9, ()),
                                             (" + async TP", 876, 67.6, ("parallel.async_tp=true",)))],
    # local batch 32 in 8 micro-batches of 4: torchtitan 9dec370's build_pipeline_schedule takes
    # n_microbatches = pipeline_parallel_degree when the config names none (Table 5 names none)
    "pp405b": [
        ("1F1B", 100, 82.5, (*B405, *MB4, SPLIT8)),
        ("interleaved (v=2)", 128, 72.7, (*B405, *MB4, "parallel.pp_schedule=interleaved",
                                          "parallel.pp_virtual_stages=2", SPLIT16)),
    ],
    "cp405b": [(f"FSDP {8 // cp}, CP {cp}, {seq // 1024}K", tps, mem,
                _cp(seq, cp, *B405, SPLIT8, per_rank=8))
               for cp, seq, tps, mem in ((1, 32768, 76, 75.3), (2, 65536, 47, 75.9),
                                         (4, 131072, 31, 77.1), (8, 262144, 16, 84.9))],
    "sched70b": [(f"{gpus} GPUs PP {pp} {sched}{' + async TP' if atp else ''}", None, None,
                  (*B70, f"cluster.num_nodes={gpus // 8}", f"parallel.pp={pp}", "parallel.zero_stage=1",
                   "parallel.recompute=full", f"parallel.global_batch_size={gpus // 2}", *FAST,
                   f"parallel.pp_schedule={sched}",
                   f"parallel.pp_virtual_stages={1 if sched in ('1f1b', 'zb_h1') else 2}",
                   f"parallel.async_tp={'true' if atp else 'false'}"))
                 for gpus, pp in ((64, 4), (128, 8))
                 for sched in ("1f1b", "interleaved", "zb_v", "dualpipev") for atp in (False, True)],
}


def run(section: str, k: int) -> dict:
    """One row simulated as `paratwin simulate` would; its figures as a dict."""
    from benchmarks.presets import cli_job
    from twin.sim.engine import SimOptions
    from twin.sim.run import simulate
    from twin.spec import ConfigError

    label, tps, mem, overrides = ROWS[section][k]
    out = {"section": section, "row": label, "published_tps_per_gpu": tps,
           "published_memory_GiB": mem}
    try:
        job, cost = cli_job(*overrides)
    except ConfigError as err:
        return {**out, "error": str(err).splitlines()[0][:160]}
    s = simulate(job, cost, SimOptions(fold="auto"), trace=None).summary
    gpus = job.grid.world_size
    out.update(gpus=gpus, seq_len=job.model.seq_len, step_time_s=s["step_time_s"],
               tps_per_gpu=s["tokens_per_s"] / gpus, mfu=s["mfu"], mfu_peak=s["mfu_peak_dtype"],
               memory_GiB=s["peak_memory_max_bytes"] / 2**30, fits=s["fits_memory"],
               bubble=s["bubble_fraction"], wall_s=s["wall_s"])
    if tps:
        out["error_tps"] = out["tps_per_gpu"] / tps - 1
    return out


def table(rows: list[dict]) -> str:
    lines = [f"  {'row':<34} {'pub TPS':>8} {'twin TPS':>9} {'err':>7} {'pub GiB':>8} "
             f"{'twin GiB':>9} {'MFU':>11} {'bubble':>7} {'step s':>8}"]
    for r in rows:
        if "error" in r:
            lines.append(f"  {r['row']:<34} {r['error']}")
            continue
        pub = f"{r['published_tps_per_gpu']:>8,}" if r["published_tps_per_gpu"] else f"{'-':>8}"
        err = f"{r['error_tps']:>+7.0%}" if "error_tps" in r else f"{'':>7}"
        pmem = f"{r['published_memory_GiB']:>8.1f}" if r["published_memory_GiB"] else f"{'-':>8}"
        mfu = f"{r['mfu']:.1%} {r['mfu_peak']}"
        lines.append(f"  {r['row']:<34} {pub} {r['tps_per_gpu']:>9,.0f} {err} {pmem} "
                     f"{r['memory_GiB']:>9.1f} {mfu:>11} {r['bubble']:>7.1%} {r['step_time_s']:>8.2f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--only", nargs="+", choices=list(ROWS))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    sections = args.only or list(ROWS)
    work = [(s, k) for s in sections for k in range(len(ROWS[s]))]
    rows = [None] * len(work)
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {pool.submit(run, *w): i for i, w in enumerate(work)}
        for n, fut in enumerate(as_completed(futures), 1):
            r = rows[futures[fut]] = fut.result()
            print(f"[{n}/{len(work)}] {r['section']}: {r['row']} ({r.get('wall_s', 0):.0f} s)",
                  file=sys.stderr, flush=True)
    for s in sections:
        print(f"\n{s}:")
        print(table([r for r in rows if r["section"] == s]))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
