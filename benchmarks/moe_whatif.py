"""What-ifs for the models people train now: MoE (expert parallelism), HSDP and FP8 on H100s.

Run: python benchmarks/moe_whatif.py [--jobs N] [--only mixtral|deepseek] [--json FILE]

Mixtral 8x7B on 64 H100s (8 nodes, global batch 256 x 4K tokens) and DeepSeek-V3 (671B)
on 256 H100s (32 nodes, global batch 1024 x 4K), each under 4 plans (EP degree and
placement, pipeline depth, full FSDP vs HSDP), each with FP8 off and on (torchao-style
tensorwise FP8 of the layers' linear GEMMs, parallel.float8), all under torch.compile
(parallel.compile=true: FP8 pays only compiled, where its casts fuse; in eager PyTorch the
twin finds it 3-5% slower than bf16, as torchao warns). Every run is `paratwin simulate`
with calibration=auto (the dgx_h100 profile, derived from published H100 kernel and NCCL
figures) and fold=auto, full activation recomputation. Prints, per plan: step
time, tokens/s per GPU, model TFLOP/s per GPU, MFU (and whose peak: bf16, or fp8 with FP8
on), the all-to-all time not hidden behind compute (ep and edp groups), all exposed
communication, the peak memory and whether it fits. Prints figures, asserts nothing. Takes
several minutes on 2 cores (plans with expert groups simulate every rank).

Published figures to hold these against (cited, with their differences from these plans):
- Mixtral 8x7B, bf16, H100: 468 TFLOP/s per GPU with Megatron-Core v0.9 (NVIDIA
  Megatron-LM, megatron/core/transformer/moe/README.md): grouped GEMMs, fused permutation,
  overlapped EP communication, which the twin's eager-PyTorch profile does not assume.
- DeepSeek-V3: 2.664M H800 GPU hours for 14.8T pre-training tokens (arXiv:2412.19437,
  Table 1: 180K GPU hours per trillion tokens), i.e. 1,543 tokens/s per GPU on 2,048 H800s
  with FP8 (1x128 tile / 128x128 block scaling), DualPipe overlapping the all-to-alls, PP16,
  EP64 and node-limited routing (each token to at most 4 nodes).
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

COMMON = ("cluster=dgx_h100", "parallel.recompute=full", "parallel.compile=true")
MIXTRAL = ("model=mixtral_8x7b", "cluster.num_nodes=8", "parallel.global_batch_size=256", *COMMON)
DEEPSEEK = ("model=deepseek_v3", "cluster.num_nodes=32", "parallel.global_batch_size=1024", *COMMON)
DS_PP8 = ("parallel.pp=8", "parallel.pp_stage_layers=[7,8,8,8,8,8,8,6]")
PLANS = {  # name: (model, description, overrides)
    "mixtral fsdp dp64": ("mixtral", "FSDP over all 64 ranks (experts on the dense groups)",
                          (*MIXTRAL, "parallel=fsdp")),
    "mixtral hsdp 2x32": ("mixtral", "HSDP: shard over 4 nodes, 2 replicas (8 x 8 does not fit)",
                          (*MIXTRAL, "parallel=hsdp", "parallel.dp_replicate=2")),
    "mixtral ep8 zero1": ("mixtral", "EP 8 inside a node, ZeRO-1 over dp 64",
                          (*MIXTRAL, "parallel=zero1", "parallel.ep=8")),
    "mixtral pp4 ep8": ("mixtral", "PP 4 (1F1B) x EP 8, ZeRO-1",
                        (*MIXTRAL, "parallel=zero1", "parallel.pp=4", "parallel.ep=8")),
    "deepseek pp8 ep32 across": ("deepseek", "PP 8 inside a node, EP 32 across 32 nodes",
                                 (*DEEPSEEK, "parallel=zero1", *DS_PP8, "parallel.ep=32")),
    "deepseek pp8 ep32 4-node": ("deepseek", "PP 8 across nodes, EP 32 over 4 nodes",
                                 (*DEEPSEEK, "parallel=zero1", *DS_PP8, "parallel.ep=32",
                                  "parallel.rank_order=tp-cp-dp-pp")),
    "deepseek pp8 ep8 node": ("deepseek", "PP 8 across nodes, EP 8 inside a node",
                              (*DEEPSEEK, "parallel=zero1", *DS_PP8, "parallel.ep=8",
                               "parallel.rank_order=tp-cp-dp-pp", "parallel.optimizer_dtype=bf16")),
    "deepseek pp16 ep16": ("deepseek", "PP 16 across nodes, EP 16 over 2 nodes",
                           (*DEEPSEEK, "parallel=zero1", "parallel.pp=16",
                            "parallel.pp_stage_layers=[3,4,4,4,4,4,4,4,4,4,4,4,4,4,4,2]",
                            "parallel.ep=16", "parallel.rank_order=tp-cp-dp-pp")),
}
PUBLISHED = {
    "mixtral": "Megatron-Core v0.9: 468 TFLOP/s per H100, bf16 (MoE README)",
    "deepseek": "DeepSeek-V3 report: 1,543 tokens/s per H800 (FP8, DualPipe, EP64, 2,048 GPUs)",
}


def run(name: str, fp8: bool) -> dict:
    """One plan simulated as `paratwin simulate` would; its figures as a dict."""
    from benchmarks.presets import cli_job
    from twin.sim.engine import SimOptions
    from twin.sim.run import simulate
    from twin.spec import ConfigError
    from twin.workload.memory import rank_memory

    model, _, overrides = PLANS[name]
    try:
        job, cost = cli_job(*overrides, f"parallel.float8={'tensorwise' if fp8 else 'none'}")
    except ConfigError as err:
        return {"plan": name, "fp8": fp8, "error": str(err).splitlines()[0]}
    peak = max(rank_memory(job, job.grid.rank(pp=s)).total for s in range(job.parallel.pp))
    out = {"plan": name, "model": model, "fp8": fp8, "gpus": job.grid.world_size,
           "peak_memory_bytes": peak, "fits": peak <= job.cluster.hbm_bytes}
    if not out["fits"]:
        return out
    s = simulate(job, cost, SimOptions(fold="auto"), trace=None).summary
    exposed = s["exposed_comm_s"]
    out.update(step_time_s=s["step_time_s"], tokens_per_gpu_s=s["tokens_per_s"] / out["gpus"],
               tflops_per_gpu=s["tflops_per_gpu"], mfu=s["mfu"], mfu_peak=s["mfu_peak_dtype"],
               exposed_a2a_s=sum(v for k, v in exposed.items() if k in ("ep", "edp")),
               exposed_comm_s=sum(exposed.values()), wall_s=s["wall_s"])
    return out


def table(rows: list[dict]) -> str:
    lines = [f"{'plan':<26} {'fp8':<4} {'step s':>8} {'tok/s/GPU':>9} {'TFLOP/s':>8} "
             f"{'MFU':>11} {'a2a exp s':>9} {'comm exp s':>10} {'peak GB':>8} {'fits':>4}"]
    for r in rows:
        head = f"{r['plan']:<26} {'on' if r['fp8'] else 'off':<4}"
        if "error" in r:
            lines.append(f"{head} {r['error']}")
        elif not r["fits"]:
            lines.append(f"{head} {'':>8} {'':>9} {'':>8} {'':>11} {'':>9} {'':>10} "
                         f"{r['peak_memory_bytes'] / 1e9:>8.1f} {'no':>4}")
        else:
            mfu = f"{r['mfu']:.1%} {r['mfu_peak']}"
            lines.append(f"{head} {r['step_time_s']:>8.2f} {r['tokens_per_gpu_s']:>9,.0f} "
                         f"{r['tflops_per_gpu']:>8.1f} {mfu:>11} {r['exposed_a2a_s']:>9.2f} "
                         f"{r['exposed_comm_s']:>10.2f} {r['peak_memory_bytes'] / 1e9:>8.1f} "
                         f"{'yes':>4}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2, help="processes (default 2)")
    ap.add_argument("--only", choices=("mixtral", "deepseek"), help="one model's plans")
    ap.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    args = ap.parse_args()
    names = [n for n, (m, _, _) in PLANS.items() if args.only in (None, m)]
    work = [(n, fp8) for n in names for fp8 in (False, True)]
    rows = [None] * len(work)
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {pool.submit(run, *w): i for i, w in enumerate(work)}
        for n, fut in enumerate(as_completed(futures), 1):
            r = rows[futures[fut]] = fut.result()
            print(f"[{n}/{len(work)}] {r['plan']}, FP8 {'on' if r['fp8'] else 'off'} "
                  f"({r.get('wall_s', 0):.0f} s)", file=sys.stderr, flush=True)
    for model in dict.fromkeys(PLANS[n][0] for n in names):
        print(f"\n{model}: {PUBLISHED[model]}")
        for n in names:
            if PLANS[n][0] == model:
                print(f"  {n}: {PLANS[n][1]}")
        print(table([r for r in rows if PLANS[r["plan"]][0] == model]))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
