"""A GEMM's rate over seconds of back-to-back calls: the burst a kernel sweep times against the
sustained rate of a long training step (clocks fall as the GPU reaches its power limit).

    python benchmarks/gemm_sustained.py [--n 8192] [--seconds 3] [--dtype bf16]

Runs n x n x n GEMMs back to back for about ``--seconds``, an event every ``--every`` calls,
and prints TFLOP/s in each window of the run (the first windows are the burst), the ratio of
the last second's rate to the first window's, and the SM clock nvidia-smi reads at the end.
Needs a GPU (not run by CI).
"""

from __future__ import annotations

import argparse
import subprocess
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: this script needs a GPU", file=sys.stderr)
        return 2
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    a = torch.randn(args.n, args.n, device="cuda", dtype=dt)
    b = torch.randn(args.n, args.n, device="cuda", dtype=dt)
    c = torch.empty_like(a)
    flops = 2.0 * args.n ** 3
    torch.mm(a, b, out=c)
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    per_call = None
    marks = []
    calls = 0
    while True:
        for _ in range(args.every):
            torch.mm(a, b, out=c)
        calls += args.every
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        marks.append((calls, ev))
        if per_call is None:
            torch.cuda.synchronize()
            per_call = start.elapsed_time(ev) / 1e3 / calls
        if calls * per_call > args.seconds:
            break
    torch.cuda.synchronize()
    prev_calls, prev_t = 0, 0.0
    rates = []
    for n_calls, ev in marks:
        t = start.elapsed_time(ev) / 1e3
        rates.append((t, (n_calls - prev_calls) * flops / (t - prev_t) / 1e12))
        prev_calls, prev_t = n_calls, t
    step = max(1, len(rates) // 15)
    for t, r in rates[::step]:
        print(f"  t {t:7.3f} s   {r:7.1f} TFLOP/s")
    total = rates[-1][0]
    last = [r for t, r in rates if t >= total - 1.0]
    print(f"first window {rates[0][1]:.1f} TFLOP/s, last second {sum(last) / len(last):.1f} TFLOP/s: "
          f"sustained/burst {sum(last) / len(last) / rates[0][1]:.3f}")
    try:
        clk = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        print("nvidia-smi after:", clk.stdout.strip())
    except (OSError, subprocess.TimeoutExpired):
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
