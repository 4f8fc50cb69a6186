"""Calibration data from a GPU machine in minutes: kernel sweep, collective sweep, replayed schedules.

On one GPU: the kernel sweep (GEMM over shapes and dtypes, from 256^3 and GPT-2's own
layer shapes, where launch latency dominates, up to 16k x 8k, and GEMMs of unaligned n or
k; attention forward and backward, elementwise, fused Adam), three replayed single-GPU
schedules (the executor's CUDA path: streams, events, torch.cuda.max_memory_allocated) for
holding the fitted profile to steps it never saw (GPT-2's layer GEMMs are swept shapes, the
Llama's and the LM heads are not): GPT-2 small at micro-batch 1 (host-bound:
small kernels) and 8, and a 4-layer Llama-3 8B at micro-batch 2 (large GEMMs); then real
eager PyTorch training of the same sizes (torch_train_gpu.py), a GEMM's sustained rate
(gemm_sustained.py) and the replay's own host cost (replay_host.py). Each step's output is
kept in --out/logs/stepK.log. Read the results with gpu_replays.py and torch_train_gpu.py
(benchmarks/results/H200.md: what one H200 gave). With several GPUs also: the
NCCL collective sweep (every IR kind, 4 KB to 256 MB, group sizes 2, 4, ... n), the
replayed-vs-bare all-reduce comparison, and one replayed multi-GPU schedule (FSDP).
Everything lands under --out (default reports/gpu_calibration/<timestamp>); feed the
CSVs to `paratwin calibrate`. Not run by CI (no GPU there).

    python benchmarks/gpu_calibration.py [--out DIR] [--quick] [--dry-run]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARATWIN = [sys.executable, "-m", "paratwin.main"]

GEMMS = [[m, n, k] for m, n, k in ((1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096),
                                   (8192, 8192, 8192), (8192, 4096, 4096), (4096, 14336, 4096),
                                   (4096, 4096, 14336), (16384, 8192, 1024))]
SMALL_GEMMS = [[m, n, k] for m, n, k in ((256, 256, 256), (512, 512, 512), (1024, 768, 768),
                                         (1024, 2304, 768), (1024, 3072, 768), (1024, 768, 3072),
                                         (8192, 768, 768), (8192, 3072, 768))]
"""Where launch latency and tile waste dominate: square 256 and 512, GPT-2 small's layer
GEMMs at 1,024 and 8,192 tokens (its replays below run these shapes)."""
UNALIGNED_GEMMS = [[m, n, k] for m, n, k in ((4096, 50257, 1024), (4096, 50304, 1024), (2048, 32001, 2048),
                                             (4096, 1024, 32001), (4096, 4100, 4096), (4096, 4096, 4100),
                                             (4100, 4096, 4096))]
"""n or k not a multiple of 8 elements (GPT-2's 50,257 vocabulary, a 32,001 one) beside aligned
twins (50,304; m = 4,100, which is no leading dimension): calibrate fits the share of
efficiency such GEMMs keep (KernelCost.unaligned_efficiency). None is a shape the replays run,
so the replays' LM-head GEMMs (n = 50,257) test it on shapes the fit never saw."""
ATTENTION = [[1, 32, 8, 4096, 128], [2, 16, 16, 2048, 64], [8, 32, 8, 1024, 128], [1, 12, 12, 1024, 64]]
ELEMENTWISE = [2**16, 2**20, 2**22, 2**24, 2**27]
OPTIMIZER = [2**20, 2**24, 2**27]
REPLAYS = [("gpt2_small", ["model=gpt2_small", "parallel.micro_batch_size=1"]),
           ("gpt2_small_mb8", ["model=gpt2_small", "parallel.micro_batch_size=8"]),
           ("llama3_8b_l4", ["model=llama3_8b", "model.num_layers=4", "parallel.micro_batch_size=2"])]
"""Single-GPU schedules replayed after the sweep: (directory, overrides)."""
CLUSTERS = (("H200", "dgx_h200"), ("H100", "dgx_h100"), ("A100", "dgx_a100"), ("B200", "dgx_b200"))


def cluster_for(device_name: str) -> str:
    """The cluster config of a GPU by its CUDA name (H100 when unknown)."""
    return next((c for key, c in CLUSTERS if key in device_name.upper()), "dgx_h100")


def _list(x) -> str:
    return "[" + ",".join(_list(v) if isinstance(v, list) else str(v) for v in x) + "]"


def plan(out: Path, gpus: int, quick: bool, cluster: str = "dgx_h100") -> list[tuple[str, list[str]]]:
    """(title, command) of every step for a machine with ``gpus`` GPUs of ``cluster``'s kind."""
    repeats = "5" if quick else "20"
    gemms = SMALL_GEMMS[:2] + GEMMS[:4] + UNALIGNED_GEMMS[:2] if quick else \
        SMALL_GEMMS + GEMMS + UNALIGNED_GEMMS
    steps = [("kernel sweep on GPU 0", PARATWIN + [
        "bench", "what=[kernels]", "backend=nccl", "kernels.dtypes=[bf16,fp16,fp32]",
        f"kernels.gemm={_list(gemms)}",
        f"kernels.attention={_list(ATTENTION)}", f"kernels.elementwise={_list(ELEMENTWISE)}",
        f"kernels.optimizer={_list(OPTIMIZER)}", f"kernel_repeats={repeats}",
        f"out_dir={out / 'kernels'}"])]
    steps += [(f"replayed single-GPU schedule {name} (CUDA streams and events)", PARATWIN + [
        "execute", *overrides, f"cluster={cluster}", "cluster.gpus_per_node=1", "parallel=single",
        "backend=nccl", "steps=10", "warmup=3", f"out_dir={out / 'execute' / name}"])
        for name, overrides in (REPLAYS[:1] if quick else REPLAYS)]
    bench = ROOT / "benchmarks"
    steps += [  # what the twin is held to beyond its executor, and where the time goes
        ("real eager PyTorch training steps (torch_train_gpu.py)", [
            sys.executable, str(bench / "torch_train_gpu.py"), "--measure", str(out / "torch_train.json"),
            "--steps", "5" if quick else "10"]),
        ("a GEMM's burst and sustained rate (gemm_sustained.py)", [
            sys.executable, str(bench / "gemm_sustained.py"), "--seconds", "2" if quick else "4"]),
        ("the replay's own host cost per op (replay_host.py)", [
            sys.executable, str(bench / "replay_host.py"), "--steps", "10" if quick else "20"])]
    if gpus >= 2:
        steps += [
            ("NCCL collective sweep", PARATWIN + [
                "bench", "what=[collectives]", "backend=nccl", f"world_size={gpus}",
                f"repeats={repeats}", "max_bytes=268435456", f"out_dir={out / 'collectives'}"]),
            ("replayed all-reduce vs a bare loop", [
                sys.executable, str(ROOT / "benchmarks" / "bench_replay_allreduce.py"),
                "--world", str(gpus), "--backend", "nccl", "--sizes-mb", "16", "64", "256",
                "--out", str(out / "replay_vs_bare")]),
            (f"replayed FSDP schedule on {gpus} GPUs", PARATWIN + [
                "execute", "model=gpt2_small", f"cluster={cluster}",
                f"cluster.gpus_per_node={gpus}", "parallel=fsdp", "backend=nccl", "steps=10",
                "warmup=3", f"out_dir={out / 'execute_fsdp'}"]),
        ]
    return steps


STEP_TIMEOUT_S = 600
"""A step still running after this long is killed (its output so far kept) and the next runs."""


def run_logged(cmd: list[str], log: Path, timeout_s: float = STEP_TIMEOUT_S) -> int:
    """Run ``cmd`` from the repository root, its output printed and kept in ``log``; killed
    after ``timeout_s`` (exit code -9, said in the log)."""
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        timer = threading.Timer(timeout_s, proc.kill)
        timer.start()
        try:
            for line in proc.stdout:
                print(line, end="", flush=True)
                fh.write(line)
            code = proc.wait()
        finally:
            timer.cancel()
        if code == -9:
            fh.write(f"killed after {timeout_s:.0f} s\n")
            print(f"   killed after {timeout_s:.0f} s", flush=True)
        return code


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="fewer repeats and shapes")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    ap.add_argument("--gpus", type=int, default=None, help="pretend this many GPUs (dry run)")
    ap.add_argument("--cluster", default=None,
                    help="cluster config of the replays (default: from the GPU's name, e.g. dgx_h200)")
    args = ap.parse_args()
    import torch

    gpus = args.gpus if args.gpus is not None else torch.cuda.device_count()
    if not gpus and not args.dry_run:
        print("no CUDA device: this script needs a GPU machine (use `paratwin bench` on CPU)",
              file=sys.stderr)
        return 2
    out = Path(args.out or ROOT / "reports" / "gpu_calibration" / time.strftime("%Y%m%d-%H%M%S"))
    cluster = args.cluster or cluster_for(torch.cuda.get_device_name(0) if gpus and not args.dry_run
                                          else "")
    steps = plan(out, max(gpus, 1), args.quick, cluster)
    failed = []
    if not args.dry_run:
        if out.exists() and any(out.iterdir()):  # never over another run's (or anyone's) files
            print(f"{out} is not empty; give --out a new directory", file=sys.stderr)
            return 2
        (out / "logs").mkdir(parents=True, exist_ok=True)
    for k, (title, cmd) in enumerate(steps):
        print(f"== {title}\n   {' '.join(cmd)}", flush=True)
        if args.dry_run:
            continue
        t0 = time.time()
        code = run_logged(cmd, out / "logs" / f"step{k}.log")
        print(f"   -> exit {code} in {time.time() - t0:.1f} s", flush=True)
        if code:
            failed.append(title)
    if not args.dry_run:
        print(f"\noutputs under {out}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
