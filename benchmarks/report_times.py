"""What a user waits for after the simulation: seconds to write a bench_twin row's trace
(spans.json) and its report, the report split into its parts (timeline, memory figure, the
HTML file, the Chrome/Perfetto export and the latter's sub-tracks).

Run: python benchmarks/report_times.py [JOB]   (JOB: a row of benchmarks/bench_twin.py, c-g;
default f)

Times each part by wrapping its function (perf_counter, summed over calls), as
benchmarks/pass_times.py does the simulator's passes. Prints figures, asserts nothing; this
host's noise is +-20%.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.pass_times import timed  # noqa: E402

PARTS = [  # (module, function, modules that imported it by name, label)
    ("twin.report.timeline", "timeline", (), "timeline"),
    ("twin.report.timeline", "idle_gaps", (), "timeline: idle gaps"),
    ("twin.report.timeline", "add_lod", (), "timeline: level-of-detail payload"),
    ("twin.report.memory", "memory_figure", (), "memory figure"),
    ("twin.report.html", "write", ("twin.report.build",), "HTML file"),
    ("twin.chrome", "write_chrome", ("twin.report.build",), "Chrome export"),
    ("twin.chrome", "_slots", (), "Chrome export: sub-tracks"),
]


def instrument(times: dict) -> None:
    """Wrap every part of PARTS so that ``times`` sums its seconds."""
    import importlib

    for mod, name, users, label in PARTS:
        wrapped = timed(times, label, getattr(importlib.import_module(mod), name))
        for m in (mod, *users):
            setattr(importlib.import_module(m), name, wrapped)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("job", nargs="?", default="f")
    args = ap.parse_args()
    from benchmarks.bench_twin import job_of
    from twin.files import write_json_atomic
    from twin.report import write_report
    from twin.sim.run import simulate

    times: dict[str, float] = defaultdict(float)
    instrument(times)
    _, job, cost, options, trace = job_of(args.job)
    if trace is None:
        raise SystemExit(f"row {args.job} writes no trace (rows c-g do)")
    t0 = time.perf_counter()
    res = simulate(job, cost, options, trace=trace)
    sim = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        t1 = time.perf_counter()
        res.trace.save(Path(tmp) / "spans.json")
        t2 = time.perf_counter()
        write_json_atomic(Path(tmp) / "summary.json", res.summary.to_dict())
        t3 = time.perf_counter()
        write_report([tmp], traces={Path(tmp): res.trace.as_saved()})
        t4 = time.perf_counter()
    print(f"({args.job}): {len(res.trace.spans):,} spans; simulate {sim:.2f} s, spans.json "
          f"{t2 - t1:.2f} s, report {t4 - t3:.2f} s")
    for label, sec in sorted(times.items(), key=lambda kv: -kv[1]):
        print(f"  {label:<36} {sec:6.2f}")


if __name__ == "__main__":
    main()
