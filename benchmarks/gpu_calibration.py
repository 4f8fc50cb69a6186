"""Calibration data from a GPU machine in minutes: kernel sweep, collective sweep, replayed schedules.

On one GPU: the kernel sweep (GEMM over shapes and dtypes, attention forward and
backward, elementwise, fused Adam) and one replayed single-GPU schedule (the executor's
CUDA path: streams, events, torch.cuda.max_memory_allocated). With several GPUs also: the
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARATWIN = [sys.executable, "-m", "paratwin.main"]

GEMMS = [[m, n, k] for m, n, k in ((1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096),
                                   (8192, 8192, 8192), (8192, 4096, 4096), (4096, 14336, 4096),
                                   (4096, 4096, 14336), (16384, 8192, 1024))]
ATTENTION = [[1, 32, 8, 4096, 128], [2, 16, 16, 2048, 64], [8, 32, 8, 1024, 128]]
ELEMENTWISE = [2**20, 2**24, 2**27]
OPTIMIZER = [2**24, 2**27]


def _list(x) -> str:
    return "[" + ",".join(_list(v) if isinstance(v, list) else str(v) for v in x) + "]"


def plan(out: Path, gpus: int, quick: bool) -> list[tuple[str, list[str]]]:
    """(title, command) of every step for a machine with ``gpus`` GPUs."""
    repeats = "5" if quick else "20"
    steps = [("kernel sweep on GPU 0", PARATWIN + [
        "bench", "what=[kernels]", "backend=nccl", "kernels.dtypes=[bf16,fp16,fp32]",
        f"kernels.gemm={_list(GEMMS[:4] if quick else GEMMS)}",
        f"kernels.attention={_list(ATTENTION)}", f"kernels.elementwise={_list(ELEMENTWISE)}",
        f"kernels.optimizer={_list(OPTIMIZER)}", f"kernel_repeats={repeats}",
        f"out_dir={out / 'kernels'}"]),
        ("replayed single-GPU schedule (CUDA streams and events)", PARATWIN + [
            "execute", "model=gpt2_small", "cluster=dgx_h100", "cluster.gpus_per_node=1",
            "parallel=single", "backend=nccl", "steps=10", "warmup=3",
            f"out_dir={out / 'execute_single'}"])]
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
                "execute", "model=gpt2_small", "cluster=dgx_h100",
                f"cluster.gpus_per_node={gpus}", "parallel=fsdp", "backend=nccl", "steps=10",
                "warmup=3", f"out_dir={out / 'execute_fsdp'}"]),
        ]
    return steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="fewer repeats and shapes")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    ap.add_argument("--gpus", type=int, default=None, help="pretend this many GPUs (dry run)")
    args = ap.parse_args()
    import torch

    gpus = args.gpus if args.gpus is not None else torch.cuda.device_count()
    if not gpus and not args.dry_run:
        print("no CUDA device: this script needs a GPU machine (use `paratwin bench` on CPU)",
              file=sys.stderr)
        return 2
    out = Path(args.out or ROOT / "reports" / "gpu_calibration" / time.strftime("%Y%m%d-%H%M%S"))
    steps = plan(out, max(gpus, 1), args.quick)
    failed = []
    for title, cmd in steps:
        print(f"== {title}\n   {' '.join(cmd)}", flush=True)
        if args.dry_run:
            continue
        t0 = time.time()
        code = subprocess.run(cmd, cwd=ROOT).returncode
        print(f"   -> exit {code} in {time.time() - t0:.1f} s", flush=True)
        if code:
            failed.append(title)
    if not args.dry_run:
        print(f"\noutputs under {out}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
