"""Instructions one simulated step executes, counted by valgrind (callgrind): an A/B measure
this host's noise does not move (its wall times vary +-20% run to run, more than most changes
to the engine are worth).

Run: python benchmarks/instructions.py [ROW] [--engine] [--cache]
  ROW: a row of benchmarks/bench_twin.py (a-g; default d)
  --engine: only the engine's run (twin.sim.engine.Simulation.run) on the programs of the
       row's first reduced run (or the full job where it is not fast-forwarded); the
       programs are built before the count starts
  --cache: simulate the caches too (D1 and last-level misses; about three times slower)

Each count is the difference of two runs under valgrind: the same process up to the
measured call, with and without it (imports, the job and, with --engine, the programs are
in both), string hashing seeded alike (PYTHONHASHSEED=0) so that sets and dicts iterate
alike; what still differs run to run (addresses) moves a count by about 1% (row (a):
394.6, 396.3 and 392.4 M instructions in three runs). Takes about 60x the row's wall time:
(d) a minute or two, (e) with --engine about six minutes and fifteen with --cache. Prints
figures, asserts nothing; needs valgrind.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

COUNTS = {"I": r"I\s+refs:\s+([\d,]+)", "D1 misses": r"D1\s+misses:\s+([\d,]+)",
          "LL misses": r"LL misses:\s+([\d,]+)"}
"""Valgrind's summary lines read (instructions; with --cache, data misses)."""


def inside(row: str, engine: bool, measure: bool) -> None:
    """The measured process: everything up to the call, then the call when ``measure``."""
    import gc

    from benchmarks.bench_twin import job_of
    from twin.sim.engine import Simulation, fold_classes
    from twin.sim.fastforward import PERIODS, SHORT, period_microbatches, reduced_job, reduced_microbatches
    from twin.sim.run import resolve_options, simulate
    from twin.sim.stepsim import Stepper

    _, job, cost, options, trace = job_of(row)
    if not engine:
        if measure:
            simulate(job, cost, options, trace=trace)
        return
    from twin.cost import default_cost_model

    cost = cost or default_cost_model(job.cluster)
    options, _ = resolve_options(job, options, 1)
    classes = fold_classes(job, options.fold)
    small, m = job, job.parallel.num_microbatches
    if options.fast_forward and period_microbatches(job):
        for periods in (SHORT, PERIODS):  # the first reduced run the stepper would simulate
            m_r = reduced_microbatches(job, periods)
            if 2 * m_r <= m:
                small = reduced_job(job, m_r)
                break
    gc.disable()  # as the stepper runs it (twin.sim.stepsim.quiet_gc)
    programs = Stepper(job, cost, options, classes).programs(small)
    sim = Simulation(small, programs, cost, options, classes)
    if measure:
        sim.run()


def counted(args: list[str], cache: bool) -> dict[str, int]:
    """Valgrind's counts for this script run with ``args`` (inside mode)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/out",
               *(["--cache-sim=yes"] if cache else []), sys.executable, __file__, *args]
        env = {**os.environ, "PYTHONHASHSEED": "0"}  # the same string hashes every run
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        sys.exit(f"valgrind failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    out = {}
    for key, pattern in COUNTS.items():
        hit = re.search(pattern, done.stderr)
        if hit:
            out[key] = int(hit.group(1).replace(",", ""))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("row", nargs="?", default="d")
    ap.add_argument("--engine", action="store_true")
    ap.add_argument("--cache", action="store_true")
    ap.add_argument("--inside", choices=("measure", "baseline"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inside:
        inside(args.row, args.engine, args.inside == "measure")
        return
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed: this benchmark counts instructions with "
                 "valgrind --tool=callgrind (apt install valgrind)")
    what = "the engine's run" if args.engine else "simulate"
    flags = [args.row, *(["--engine"] if args.engine else [])]
    t0 = time.perf_counter()
    base = counted([*flags, "--inside", "baseline"], args.cache)
    full = counted([*flags, "--inside", "measure"], args.cache)
    took = time.perf_counter() - t0
    print(f"({args.row}) {what}: " + ", ".join(f"{k} {full[k] - base[k]:,}" for k in full
                                               if k in base)
          + f"  (valgrind runs: {took:.0f} s)")


if __name__ == "__main__":
    main()
