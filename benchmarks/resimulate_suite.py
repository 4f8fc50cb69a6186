"""Profiles side by side on the same measured runs: re-simulate a validation suite's executed
runs under each profile (no new measurement, so the host's drift between runs cannot favour
either).

Run: python benchmarks/resimulate_suite.py VALIDATE_OUT_DIR PROFILE [PROFILE ...]
(VALIDATE_OUT_DIR: the out_dir of `paratwin validate` / `benchmarks/validate_suite.py`, whose
NAME-w2/execute run directories are re-simulated). Prints per profile the suite's figures:
median and largest |error| against the measured median step, and how many predictions fall
inside the measured p10-p90 band, then each run's error.
"""

from __future__ import annotations

import statistics
import sys
import warnings
from pathlib import Path

from twin.calibrate.traces import load_run
from twin.cost import CostModel
from twin.sim.run import simulate


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    runs = [load_run(d) for d in sorted(Path(sys.argv[1]).glob("*-w2/execute"))]
    if not runs:
        sys.exit(f"{sys.argv[1]} holds no NAME-w2/execute run directory")
    names = [r.path.parent.name for r in runs]
    print(f"{len(runs)} measured runs in {sys.argv[1]}: {', '.join(names)}")
    for path in sys.argv[2:]:
        cost = CostModel.load(path)
        errs, inside = [], 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for r in runs:
                t = simulate(r.job, cost).summary.step_time_s
                errs.append(t / r.step_s - 1)
                inside += r.step_p10_s <= t <= r.step_p90_s
        print(f"{path}: median |error| {statistics.median(map(abs, errs)):.1%}, largest "
              f"{max(map(abs, errs)):.1%}, {inside}/{len(runs)} inside the band")
        print("   " + ", ".join(f"{n} {e:+.1%}" for n, e in zip(names, errs)))


if __name__ == "__main__":
    main()
