"""How far this host drifts between two runs of the validation suite: the noise floor of its
accuracy figures.

Run: python benchmarks/suite_drift.py OUT_A/validate.json OUT_B/validate.json [OUT_C/validate.json ...]
(`paratwin validate` / `benchmarks/validate_suite.py` outputs of the same suite, measured in
different windows). Treats run A's measured medians as a perfect predictor of run B: prints per
run the change of the measured median, B's p10-p90 band, whether A's median falls inside it, and
the summary line in the suite's terms (median |drift|, largest, how many inside the band); with
more than two files, that line for every ordered pair and pooled over them, beside the twin's
own in-band count in each file. A twin that predicts one time per run cannot be expected to
beat the host's own other measurement: the pooled in-band rate is the ceiling of the suite's.
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
from pathlib import Path


def drift(a: dict, b: dict, table: bool = False) -> tuple[list[float], int]:
    """|drift| of each run A and B share, and how many of A's medians lie inside B's band;
    ``table``: print each run's line."""
    ra = {r["name"]: r for r in a["runs"] if r.get("measured_p50_s") is not None}
    rb = {r["name"]: r for r in b["runs"] if r.get("measured_p50_s") is not None}
    drifts, inside = [], 0
    if table:
        print(f"{'run':<20} {'A p50 ms':>9} {'B p50 ms':>9} {'drift':>7} {'B band':>8} inside")
    for n in (n for n in ra if n in rb):
        x, y = ra[n], rb[n]
        d = x["measured_p50_s"] / y["measured_p50_s"] - 1
        ok = y["measured_p10_s"] <= x["measured_p50_s"] <= y["measured_p90_s"]
        half = (y["measured_p90_s"] - y["measured_p10_s"]) / 2 / y["measured_p50_s"]
        drifts.append(abs(d))
        inside += ok
        if table:
            print(f"{n:<20} {x['measured_p50_s'] * 1e3:>9.1f} {y['measured_p50_s'] * 1e3:>9.1f} "
                  f"{d:>+7.1%} {'±' + format(half, '.1%'):>8} {'yes' if ok else 'no'}")
    return drifts, inside


def line(drifts: list[float], inside: int) -> str:
    return (f"{len(drifts)} runs: median |drift| {statistics.median(drifts):.1%}, largest "
            f"{max(drifts):.1%}, {inside}/{len(drifts)} of A's medians inside B's p10-p90 band")


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    files = {}
    for p in sys.argv[1:]:
        try:
            files[p] = json.loads(Path(p).read_text())
            files[p]["runs"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            sys.exit(f"{p} is not a `paratwin validate` validate.json ({type(err).__name__}: {err}); "
                     "give OUT_DIR/validate.json of a validation")
    pooled, pooled_in = [], 0
    for (pa, a), (pb, b) in itertools.permutations(files.items(), 2):
        drifts, inside = drift(a, b, table=len(files) == 2)
        if not drifts:
            sys.exit(f"{pa} and {pb} share no run")
        pooled += drifts
        pooled_in += inside
        print(("\n" if len(files) == 2 else f"A {pa}, B {pb}: ") + line(drifts, inside))
        if len(files) == 2:
            break
    if len(files) > 2:
        print(f"pooled over {len(files) * (len(files) - 1)} ordered pairs: {line(pooled, pooled_in)}"
              f" ({pooled_in / len(pooled):.0%})")
    for p, f in files.items():
        runs = [r for r in f["runs"] if r.get("measured_p50_s") is not None]
        print(f"the twin inside the band in {p}: {sum(bool(r.get('in_band')) for r in runs)} of {len(runs)}")


if __name__ == "__main__":
    main()
