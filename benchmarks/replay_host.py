"""The GPU replay's own host cost per op: where a host-bound replay's time goes.

A single-GPU program (default GPT-2 small at micro-batch 1 on one H200, the host-bound
replay of `gpu_calibration.py`) is replayed in this process by the executor's CudaReplayer,
``--steps`` steps after three warm-up ones, twice: with its events made once per op and
recorded again each step (the replayer as it is), and with a new CUDA event made for every
record (as it was before 2026-12-04). Prints per variant the median step, the host's time to
issue the step and that time per op; then the top of a cProfile of the pooled variant's host
(``--profile N`` functions by their own time). Needs a GPU (not run by CI).

    python benchmarks/replay_host.py [--steps 20] [--profile 25] [OVERRIDES ...]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.presets import cli_job  # noqa: E402

DEFAULT = ["model=gpt2_small", "cluster=dgx_h200", "cluster.gpus_per_node=1", "parallel=single",
           "parallel.micro_batch_size=1"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profile", type=int, default=25)
    ap.add_argument("overrides", nargs="*", help="simulate-style overrides (default: GPT-2 small mb 1)")
    args = ap.parse_args()
    import torch

    from executor.replay_cuda import CudaReplayer
    from twin.schedule.builder import build_schedule

    if not torch.cuda.is_available():
        print("no CUDA device: this script needs a GPU", file=sys.stderr)
        return 2

    class FreshEvents(CudaReplayer):
        """A new CUDA event for every record (the replayer before its events were pooled)."""

        def _event(self, i, end, stream=None):
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(stream)
            return ev

    job, _ = cli_job(*(args.overrides or DEFAULT))
    program = build_schedule(job).program(0)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    n = len(program.ops)
    print(f"{job.model.name} mb {job.parallel.micro_batch_size}: {n} ops per step "
          f"({sum(op.is_compute for op in program.ops)} compute)")
    for label, cls in (("pooled events", CudaReplayer), ("fresh events", FreshEvents)):
        rep = cls(program, None, device)
        for step in range(3):
            rep.run_step(step)
        walls, issued = [], []
        for step in range(args.steps):
            t0 = time.perf_counter_ns()
            res = rep.run_step(3 + step)
            walls.append((time.perf_counter_ns() - t0) / 1e6)
            issued.append(res.issued_ns / 1e6)
        w, h = statistics.median(walls), statistics.median(issued)
        print(f"{label:<14} step {w:8.2f} ms   host issue {h:8.2f} ms   {h / n * 1e3:6.1f} us per op")
    rep = CudaReplayer(program, None, device)
    for step in range(3):
        rep.run_step(step)
    prof = cProfile.Profile()
    prof.enable()
    for step in range(5):
        rep.run_step(3 + step)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.profile)
    print(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
