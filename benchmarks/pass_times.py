"""Where one simulated step's time goes: seconds per pass of the twin, for a bench_twin row or
torchtitan's 405B with async TP.

Run: python benchmarks/pass_times.py [JOB] [--build [--floor]] [--generic | --bodies-only]
                                       [--events] [--calls] [--p2p-alone]
  JOB: a row of benchmarks/bench_twin.py (a-g; default e), or asynctp405b: Llama 3.1 405B on
       512 H100s as benchmarks/long_context.py's B405 (FSDP 8 x TP 8 x PP 8, compile + FP8,
       async TP) with its 15/16x6/15 split, global batch 256 of micro-batch 1 (32
       micro-batches per pipeline)
  --build: only build the stage programs (one rank per stage) of the job with the reduced
       runs' micro-batch counts the fast-forward tries, and time that
  --floor: with --build, stamped bodies append placeholders instead of ops (no Op object,
       no name): what the builder's own logic costs, the floor of any cheaper stamped op;
       whole actions are built as bodies (as with --bodies-only: an action is recorded
       from its ops, which placeholders are not)
  --generic: build every layer body with the generic code (twin.schedule.stamp.ENABLED off:
       what stamping saves; the programs are the same)
  --bodies-only: stamp layer bodies but build every whole action with the generic code
       (twin.schedule.actions.ENABLED off: what stamping whole actions saves)
  --p2p-alone: time every send/recv as if alone on its links (its latency, then its bytes at
       its uncontended rate: one timeout, no flow): NOT the twin's result; what the fabric's
       p2p flows cost the engine and how much their sharing moves the step
  --events: count the SimPy events the engine schedules, by what scheduled them, and the
       plain events it makes (slower)
  --calls: count the Python function calls of the whole ``simulate`` (cProfile; about twice
       as slow, so its pass times mean nothing): a measure of the work done that this host's
       noise does not move, the same in every run of the same code

Times each pass by wrapping its function (perf_counter, summed over calls): program building,
the engine's event loop, the host plan, structure, walks, op tables, the fast-forward's cut,
its check of the shortest run's programs (``regular``) and counterparts, the critical path,
and the rest of ``simulate`` (spans, flows, figures).
Prints figures, asserts nothing; the wall time is one run's (this host's noise is +-20%).
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ASYNC_TP_405B = ("parallel.global_batch_size=256", "parallel.micro_batch_size=1")
PASSES = [  # (module, function, modules that imported it by name)
    ("twin.sim.walks", "structure", ("twin.sim.engine",)),
    ("twin.sim.host", "host_plan", ("twin.sim.engine",)),
    ("twin.sim.walks", "build_walk", ()),
    ("twin.sim.stats", "op_table", ("twin.sim.stepsim",)),
    ("twin.sim.counterparts", "counterparts", ("twin.sim.fastforward",)),
    ("twin.sim.fastforward", "find_cut", ("twin.sim.stepsim",)),
    ("twin.sim.fastforward", "regular", ("twin.sim.stepsim",)),
    ("twin.sim.fastforward", "expand", ("twin.sim.stepsim",)),
    ("twin.sim.critical", "critical_path", ("twin.sim.stepsim",)),
    ("twin.sim.walks", "memory_times", ("twin.sim.engine",)),
    ("twin.sim.stats", "step_figures", ("twin.sim.run",)),
]
METHODS = [("twin.schedule.ir", "Schedule", "program", "programs"),
           ("twin.sim.private", "Inliner", "streams", "inliner.streams"),
           ("simpy.core", "Environment", "run", "env.run"),
           ("twin.sim.flows", "FlowPlanner", "prepare", "flows.prepare"),
           ("twin.sim.engine", "Simulation", "_run", "engine (all)")]
INSIDE = {"engine (all)": ("env.run", "structure", "host_plan", "build_walk", "inliner.streams",
                           "flows.prepare", "memory_times"),
          "find_cut or regular": ("counterparts",)}
"""Passes timed inside another (left out of the sum that gives the rest)."""


def job_and_options(key: str):
    """(job, profile, SimOptions, trace level) of ``key``."""
    from twin.sim.engine import SimOptions

    if key == "asynctp405b":
        from benchmarks.long_context import B405, SPLIT8
        from benchmarks.presets import cli_job

        job, cost = cli_job(*B405, SPLIT8, *ASYNC_TP_405B)
        return job, cost, SimOptions(fold="auto"), "auto"
    from benchmarks.bench_twin import job_of

    _, job, cost, options, trace = job_of(key)
    return job, cost, options, trace


def timed(times: dict, label: str, f):
    """``f`` wrapped to add its wall time to ``times[label]`` (report_times.py uses it too)."""
    @functools.wraps(f)
    def run(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            times[label] += time.perf_counter() - t0
    return run


def instrument(times: dict) -> None:
    """Wrap every pass of PASSES and METHODS so that ``times`` sums its seconds."""
    for mod, name, users in PASSES:
        wrapped = timed(times, name, getattr(importlib.import_module(mod), name))
        for m in (mod, *users):
            setattr(importlib.import_module(m), name, wrapped)
    for mod, cls, name, label in METHODS:
        owner = getattr(importlib.import_module(mod), cls)
        setattr(owner, name, timed(times, label, getattr(owner, name)))


def count_events(counts: Counter) -> None:
    """Count each SimPy timeout by the function and line that made it, every other
    scheduled event by its type, and the plain events made (``made``)."""
    from simpy.core import Environment

    timeout, schedule, event = Environment.timeout, Environment.schedule, Environment.event

    def made(self):
        counts["made"] += 1
        return event(self)

    def timed(self, delay=0, value=None):
        caller = sys._getframe(1)
        counts[f"timeout {caller.f_code.co_name}:{caller.f_lineno}"] += 1
        return timeout(self, delay, value)

    def scheduled(self, event, priority=1, delay=0):
        if type(event).__name__ != "Timeout":
            counts[f"event {type(event).__name__}"] += 1
        return schedule(self, event, priority, delay)

    Environment.timeout, Environment.schedule, Environment.event = timed, scheduled, made


def stamp_placeholders() -> None:
    """Stamped bodies append ``None`` per op, with the bookkeeping ``stamp.stamp`` does
    (``stamp.placed``): the programs are not usable, only the time to build them is."""
    from twin.schedule import stamp

    def placeholders(b, t, ctx, slots, grads):
        base = len(b.ops)
        b.ops.extend([None] * t.size)
        return stamp.placed(b, t, ctx, base, grads)

    stamp.stamp = placeholders


def p2p_alone() -> None:
    """Replace the pairs' transfers by one timeout each (see --p2p-alone)."""
    from twin.sim import sendrecv

    def alone(sim, src, dst, op, waiters):
        bundle, lat = sim.flows.p2p(src, dst, op.bytes)
        x = bundle.size_bytes / bundle.alone_rate(sim.fabric.capacity) if bundle else 0.0
        sim.env.timeout(lat + x).callbacks.extend(waiters)

    sendrecv.transfer = alone


def build_only(job) -> None:
    """Build one rank per stage with each micro-batch count the stepper may simulate: its
    reduced runs (SHORT steady periods, PERIODS, then twice as many; two when that would be
    more than half) and the full job."""
    from twin.schedule.actions import ActionTemplate
    from twin.schedule.builder import build_schedule
    from twin.schedule.stamp import Template
    from twin.sim.fastforward import PERIODS, SHORT, reduced_job, reduced_microbatches

    m = job.parallel.num_microbatches
    counts = {reduced_microbatches(job, k) for k in (SHORT, 2, PERIODS, 2 * PERIODS)}
    gc.disable()  # as the simulator builds them (twin.sim.stepsim.quiet_gc)
    for m_r in sorted({c for c in counts if 2 * c <= m} | {m}):
        j = reduced_job(job, m_r)
        schedule = build_schedule(j)
        t0 = time.perf_counter()
        progs = [schedule.program(r) for r in j.grid.group(0, "pp")]
        took = time.perf_counter() - t0
        kinds = Counter(type(b[0]) for p in progs for b in p.blocks or ())
        print(f"{m_r:>4} micro-batches: {took:6.2f} s, {sum(len(p.ops) for p in progs):,} ops, "
              f"{kinds[Template]:,} stamped bodies and {kinds[ActionTemplate]:,} whole actions "
              "outside them")
    gc.enable()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("job", nargs="?", default="e")
    ap.add_argument("--build", action="store_true")
    ap.add_argument("--floor", action="store_true")
    ap.add_argument("--generic", action="store_true")
    ap.add_argument("--bodies-only", action="store_true")
    ap.add_argument("--events", action="store_true")
    ap.add_argument("--calls", action="store_true")
    ap.add_argument("--p2p-alone", action="store_true")
    args = ap.parse_args()
    if args.generic:
        from twin.schedule import stamp

        stamp.ENABLED = False
    if args.bodies_only or (args.build and args.floor):
        from twin.schedule import actions

        actions.ENABLED = False
    job, cost, options, trace = job_and_options(args.job)
    if args.build:
        if args.floor:
            stamp_placeholders()
        build_only(job)
        return
    times: dict[str, float] = defaultdict(float)
    counts: Counter = Counter()
    instrument(times)
    if args.events:
        count_events(counts)
    if args.p2p_alone:
        p2p_alone()
    from twin.sim.run import simulate

    profile = None
    if args.calls:
        import cProfile

        profile = cProfile.Profile()
        profile.enable()
    t0 = time.perf_counter()
    res = simulate(job, cost, options, trace=trace)
    wall = time.perf_counter() - t0
    if profile is not None:
        import io
        import pstats

        profile.disable()
        calls = pstats.Stats(profile, stream=io.StringIO()).total_calls
        print(f"Python function calls in simulate: {calls:,} (under cProfile: times below "
              "are inflated)")
    s = res.summary
    ff = s["fast_forward"]
    print(f"{args.job}: wall {wall:.2f} s, step {s['step_time_s']:.6f} s, {s['ops']:,} ops, "
          f"{s['events']:,} events, fast-forwarded: "
          f"{ff['simulated_microbatches'] if ff else 'no'}")
    inner = {k: outer for outer, ks in INSIDE.items() for k in ks}
    for label, sec in sorted(times.items(), key=lambda kv: -kv[1]):
        note = f" (inside {inner[label]})" if label in inner else ""
        print(f"  {label:<16} {sec:7.2f}{note}")
    timed = times.get("engine (all)", 0.0) - sum(times.get(k, 0.0) for k in INSIDE["engine (all)"])
    print(f"  {'engine, rest':<16} {timed:7.2f} (inside engine (all): events, processes, op codes, arrays)")
    outside = wall - sum(v for k, v in times.items() if k not in inner)
    print(f"  {'rest':<16} {outside:7.2f} (spans for the trace, op tables' codes, conversions)")
    if counts:
        made = counts.pop("made", 0)
        print(f"events made (Environment.event): {made:,}")
        print(f"events scheduled: {sum(counts.values()):,}")
        for what, n in counts.most_common(12):
            print(f"  {n:>9,} {what}")


if __name__ == "__main__":
    main()
