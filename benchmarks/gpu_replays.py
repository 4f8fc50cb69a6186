"""The twin against the executor's replays on a GPU: each stored run simulated under each profile.

Run: python benchmarks/gpu_replays.py RESULTS_DIR [PROFILE ...]
(RESULTS_DIR: an output of `benchmarks/gpu_calibration.py`, e.g.
benchmarks/results/h200_20261204, whose execute/NAME directories are the replays; PROFILE: a
name under conf/profiles or a path; default the cluster's own profile (`auto`) and the kernel
sweep's fit, as `paratwin calibrate bench_dir=RESULTS_DIR/kernels` fits it, shown also without
its shape factors, which time each swept shape as measured). The replays are steps the kernel
fit never saw: each is a whole step of the schedule's ops, issued by the host one after another
as in training, where the sweep timed each kernel alone. Their kernels are another matter: the
sweep holds GPT-2 small's layer GEMMs (so the GPT-2 replays' GEMM times are fitted ones, and
without shape factors still points of the fit); none of the Llama replay's GEMM shapes and no
LM-head GEMM of either was swept.

Prints per run its ops per step, the host's time to issue them (`host_issue_s`, where the
run recorded it), the measured median step (p10-p90) and per profile the predicted step and its
error; then per op kind the measured mean time per step against each profile's, so a step's
error can be traced to the kind that makes it.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import statistics
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from paratwin.config import load_profile  # noqa: E402
from twin.calibrate.profile import build_profile  # noqa: E402
from twin.calibrate.traces import TracedRun, TraceError, load_run  # noqa: E402
from twin.cost import CostModel  # noqa: E402
from twin.sim.run import simulate  # noqa: E402
from twin.spec import ConfigError  # noqa: E402


def kind_seconds(spans, steps: int) -> dict[str, float]:
    """Seconds per step spent in each op kind (bwd ops apart), compute stream only."""
    out: dict[str, float] = collections.defaultdict(float)
    for s in spans:
        if s.stream == "compute":
            out[s.kind + (".bwd" if s.phase == "bwd" else "")] += (s.end_us - s.start_us) / 1e6 / steps
    return dict(out)


def kernel_fit(kernels_dir: Path, cluster) -> CostModel:
    """The profile `paratwin calibrate bench_dir=` fits to the kernel sweep in ``kernels_dir``."""
    return build_profile(kernels_dir, cluster, f"{cluster.name}_kernel_sweep", "bf16")[0]


def compare(runs: list[TracedRun], profiles: dict[str, CostModel]) -> None:
    names = [r.path.name for r in runs]
    print(f"{'run':<16} {'ops':>4} {'host issue ms':>13} {'measured ms (p10-p90)':>24}  " +
          "  ".join(f"{p[:22]:>22}" for p in profiles))
    rows = []
    for name, r in zip(names, runs):
        measured_steps = len({s.step for s in r.spans})
        preds = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for label, cost in profiles.items():
                res = simulate(r.job, cost, trace="full")
                preds[label] = (res.summary.step_time_s, kind_seconds(res.trace.spans, 1))
        rows.append((name, kind_seconds(r.spans, measured_steps), preds))
        band = f"{r.step_s * 1e3:.2f} ({r.step_p10_s * 1e3:.2f}-{r.step_p90_s * 1e3:.2f})"
        issued = json.loads((r.path / "summary.json").read_text()).get("host_issue_s") or {}
        host = f"{statistics.median(issued.values()) * 1e3:.2f}" if issued else "-"
        ops = len(r.programs[min(r.programs)])
        print(f"{name:<16} {ops:>4} {host:>13} {band:>24}  " + "  ".join(
            f"{t * 1e3:>11.2f} {t / r.step_s - 1:>+9.1%}" for t, _ in preds.values()))
    print("\nper op kind, ms per step: measured | " + " | ".join(profiles))
    for name, measured, preds in rows:
        print(f"  {name}")
        for kind in sorted(measured, key=lambda k: -measured[k]):
            print(f"    {kind:<16} {measured[kind] * 1e3:>9.2f} | " + " | ".join(
                f"{p[1].get(kind, 0.0) * 1e3:>9.2f}" for p in preds.values()))


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    results = Path(sys.argv[1])
    try:
        runs = [load_run(d) for d in sorted((results / "execute").glob("*")) if d.is_dir()]
    except TraceError as err:
        sys.exit(str(err))
    if not runs:
        sys.exit(f"{results} holds no execute/NAME run directory")
    cluster = runs[0].job.cluster
    profiles = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a profile fitted on another cluster is asked for
        for n in sys.argv[2:] or ["auto"]:
            try:
                profiles[cluster.name if n == "auto" else n] = load_profile(n, cluster)
            except ConfigError as err:
                sys.exit(str(err))
    if len(sys.argv) < 3:
        fitted = kernel_fit(results / "kernels", cluster)
        profiles["kernel sweep fit"] = fitted
        profiles["sweep, no shape factors"] = dataclasses.replace(fitted, shape_factors={})
    compare(runs, profiles)

if __name__ == "__main__":
    main()
