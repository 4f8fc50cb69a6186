"""The twin against real eager PyTorch training on one GPU: step times measured, then predicted.

    python benchmarks/torch_train_gpu.py --measure OUT.json   # on a GPU machine: train and time
    python benchmarks/torch_train_gpu.py OUT.json [PROFILE ...] # anywhere: the twin's predictions

Measuring trains each case's model (executor/conformance/model.py: Llama-style, RMSNorm,
RoPE, causal SDPA, SwiGLU; fp32 parameters under bf16 autocast, fused AdamW, gradients
clipped with foreach; the same step the twin's `parallel=single` schedule holds) on random
tokens, ``--steps`` steps after three warm-up ones, each timed from a synchronize to the next
(and the host's time to issue it), and writes the medians with the device and versions.
Predicting simulates each case's job (`paratwin simulate` with the case's overrides) under
each profile (default: the cluster's own `dgx_h200`, derived from published figures, and
`h200_sweep`, fitted to this repository's H200 kernel sweep) and prints the error of each.
Neither profile saw these steps. Not run by CI (no GPU there).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.presets import cli_job  # noqa: E402

LLAMA_FLAVOUR = ["model.activation=swiglu", "model.norm=rmsnorm", "model.position_embedding=rope",
                 "model.bias=false"]
SINGLE = ["cluster=dgx_h200", "cluster.gpus_per_node=1", "parallel=single"]
CASES = {
    # GPT-2 small's sizes in the Llama flavour the model builds: 50,257 tokens (unaligned)
    "gpt2s_llama_mb1": ["model=gpt2_small", *LLAMA_FLAVOUR, "parallel.micro_batch_size=1"],
    "gpt2s_llama_mb8": ["model=gpt2_small", *LLAMA_FLAVOUR, "parallel.micro_batch_size=8"],
    "llama3_8b_l4_mb2": ["model=llama3_8b", "model.num_layers=4", "parallel.micro_batch_size=2"],
    "tiny": ["model=tiny", "parallel.micro_batch_size=2"],  # a smoke test (CPU)
}


def measure(name: str, overrides: list[str], steps: int, device: str) -> dict:
    import torch
    import torch.nn.functional as F

    from executor.conformance.model import Llama

    job, _ = cli_job(*overrides, *SINGLE)
    spec = dataclasses.replace(job.model, dtype="fp32")  # fp32 parameters; bf16 under autocast
    torch.manual_seed(0)
    dev = torch.device(device)
    model = Llama(spec).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0,
                            fused=dev.type == "cuda")
    b, s = job.parallel.micro_batch_size, spec.seq_len
    x = torch.randint(0, spec.vocab_size, (b, s), device=dev)
    y = torch.randint(0, spec.vocab_size, (b, s), device=dev)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def step():
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, spec.vocab_size).float(), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    sync()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    walls, issued = [], []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        step()
        issued.append(time.perf_counter() - t0)
        sync()
        walls.append(time.perf_counter() - t0)
    walls.sort()
    out = {"case": name, "overrides": overrides, "step_s": statistics.median(walls),
           "step_p10_s": walls[len(walls) // 10], "step_p90_s": walls[-1 - len(walls) // 10],
           "host_issue_s": statistics.median(issued), "steps": steps,
           "params": sum(p.numel() for p in model.parameters())}
    if dev.type == "cuda":
        out["peak_memory_bytes"] = torch.cuda.max_memory_allocated(dev)
        try:
            out["gpu_ms_by_kind"] = kernel_kinds(step, sync)
        except Exception as err:  # the timings stand without the breakdown
            out["gpu_ms_by_kind"] = {"error": repr(err)}
    print(f"{name:<18} step {out['step_s'] * 1e3:9.2f} ms (p10 {out['step_p10_s'] * 1e3:.2f}, p90 "
          f"{out['step_p90_s'] * 1e3:.2f})  host issue {out['host_issue_s'] * 1e3:8.2f} ms", flush=True)
    return out


KERNEL_KINDS = (("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
                ("optimizer", ("adam", "multi_tensor")),
                ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90", "sm80")))


def kernel_kinds(step, sync) -> dict[str, float]:
    """GPU milliseconds of one step's kernels by kind (their names; the rest elementwise),
    from torch.profiler, and ``busy``: their sum (the GPU's busy time, overlaps aside); then
    what the host did for them: ``kernels`` launched, ``aten_ops`` dispatched (every aten
    call, nested ones too) and ``launch_api_ms`` in the runtime's launch calls (the counts
    a model of eager PyTorch's host cost per op needs)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        sync()
    out: dict[str, float] = {}
    host = {"kernels": 0, "aten_ops": 0, "launch_api_ms": 0.0}
    for evt in prof.key_averages():
        if getattr(evt, "device_type", None) != DeviceType.CUDA:
            if evt.key.startswith("aten::"):
                host["aten_ops"] += evt.count
            elif "LaunchKernel" in evt.key or "cuLaunch" in evt.key:
                host["kernels"] += evt.count
                host["launch_api_ms"] += evt.self_cpu_time_total / 1e3
            continue
        ms = getattr(evt, "self_device_time_total", 0.0) / 1e3
        name = evt.key.lower()
        kind = next((k for k, keys in KERNEL_KINDS if any(w in name for w in keys)), "elementwise")
        out[kind] = out.get(kind, 0.0) + ms
    out["busy"] = sum(out.values())
    return {**out, **host}


def predict(path: Path, profiles: list[str]) -> None:
    from paratwin.config import load_profile, preset_cluster
    from twin.sim.run import simulate
    from twin.spec import ConfigError

    try:
        data = json.loads(path.read_text())
        runs, device = data["runs"], f"{data['device']} (torch {data['torch']}, {data['date']})"
    except (OSError, ValueError, KeyError, TypeError) as err:
        sys.exit(f"{path} is not a `torch_train_gpu.py --measure` output ({err!r}); measure one "
                 "with --measure OUT on a GPU machine")
    print(f"measured on {device}")
    print(f"{'case':<18} {'measured ms':>12} {'host ms':>8}  " + "  ".join(f"{p:>20}" for p in profiles))
    try:
        costs = {p: load_profile(p, preset_cluster("dgx_h200")) for p in profiles}
    except ConfigError as err:
        sys.exit(str(err))
    errors: dict[str, list[float]] = {p: [] for p in profiles}
    for run in runs:
        job, _ = cli_job(*run["overrides"], *SINGLE)
        cells = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for p, cost in costs.items():
                t = simulate(job, cost, trace="none").summary.step_time_s
                errors[p].append(t / run["step_s"] - 1)
                cells.append(f"{t * 1e3:10.2f} {errors[p][-1]:+8.1%}")
        print(f"{run['case']:<18} {run['step_s'] * 1e3:12.2f} {run['host_issue_s'] * 1e3:8.2f}  "
              + "  ".join(f"{c:>20}" for c in cells))
    for p, e in errors.items():
        print(f"{p}: median |error| {statistics.median(map(abs, e)):.1%}, largest {max(map(abs, e)):.1%}")
    print("GPU ms per step by kernel kind (torch.profiler, one step):")
    for run in runs:
        kinds = run.get("gpu_ms_by_kind") or {}
        print(f"  {run['case']:<18} " + ", ".join(
            f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in kinds.items()))
        if kinds.get("kernels"):
            print(f"  {'':<18} host: {run['host_issue_s'] * 1e6 / kinds['kernels']:.1f} us per kernel "
                  f"launched, {run['host_issue_s'] * 1e6 / max(1, kinds['aten_ops']):.1f} us per aten op")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="?", help="a JSON written by --measure (predict mode)")
    ap.add_argument("profiles", nargs="*", default=["dgx_h200", "h200_sweep"])
    ap.add_argument("--measure", metavar="OUT", help="train and time the cases, write OUT")
    ap.add_argument("--cases", nargs="*", default=[c for c in CASES if c != "tiny"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    if not args.measure:
        if not args.results:
            ap.error("give a results JSON to predict, or --measure OUT to measure")
        predict(Path(args.results), args.profiles)
        return 0
    if Path(args.measure).exists():  # a user's file is theirs: measure into a new one
        print(f"{args.measure} exists; give --measure a new file", file=sys.stderr)
        return 2
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: measuring needs a GPU (--device cpu for a smoke test)", file=sys.stderr)
        return 2
    runs = []
    for name in args.cases:
        runs.append(measure(name, CASES[name], args.steps, args.device))
        if args.device == "cuda":
            torch.cuda.empty_cache()
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    Path(args.measure).write_text(json.dumps({
        "device": device, "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
