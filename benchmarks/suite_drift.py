"""How far this host drifts between two runs of the validation suite: the noise floor of its
accuracy figures.

Run: python benchmarks/suite_drift.py OUT_A/validate.json OUT_B/validate.json
(two `paratwin validate` / `benchmarks/validate_suite.py` outputs of the same suite).
Treats run A's measured medians as a perfect predictor of run B: prints per run the change of
the measured median, B's p10-p90 band, whether A's median falls inside it, and the summary
line in the suite's terms (median |drift|, largest, how many inside the band). A twin cannot
be expected to beat the host's own earlier measurement.
"""

from __future__ import annotations

import json
import statistics
import sys


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    a, b = (json.load(open(p)) for p in sys.argv[1:])
    ra = {r["name"]: r for r in a["runs"]}
    rb = {r["name"]: r for r in b["runs"]}
    names = [n for n in ra if n in rb]
    print(f"{'run':<20} {'A p50 ms':>9} {'B p50 ms':>9} {'drift':>7} {'B band':>8} inside")
    drifts, inside = [], 0
    for n in names:
        x, y = ra[n], rb[n]
        drift = x["measured_p50_s"] / y["measured_p50_s"] - 1
        ok = y["measured_p10_s"] <= x["measured_p50_s"] <= y["measured_p90_s"]
        half = (y["measured_p90_s"] - y["measured_p10_s"]) / 2 / y["measured_p50_s"]
        drifts.append(abs(drift))
        inside += ok
        print(f"{n:<20} {x['measured_p50_s'] * 1e3:>9.1f} {y['measured_p50_s'] * 1e3:>9.1f} "
              f"{drift:>+7.1%} {'±' + format(half, '.1%'):>8} {'yes' if ok else 'no'}")
    if not names:
        sys.exit("the two files share no run")
    print(f"\n{len(names)} runs: median |drift| {statistics.median(drifts):.1%}, largest "
          f"{max(drifts):.1%}, {inside}/{len(names)} of A's medians inside B's p10-p90 band")


if __name__ == "__main__":
    main()
