"""The twin against the executor's replays on a GPU: each stored run simulated under each profile.

Run: python benchmarks/gpu_replays.py RESULTS_DIR [PROFILE ...]
(RESULTS_DIR: an output of `benchmarks/gpu_calibration.py`, e.g.
benchmarks/results/h200_20261204, whose execute/NAME directories are the replays; PROFILE: a
name under conf/profiles or a path; default the cluster's own profile (`auto`) and the kernel
sweep's fit, written by `paratwin calibrate bench_dir=RESULTS_DIR/kernels` into a temporary
file; it is shown also without its shape factors, which time each swept shape as measured).
The replays are data the kernel fit never saw: each is a whole step of the schedule's
ops, issued by the host one after another as in training, where the sweep timed each kernel
alone.

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
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from twin.calibrate.traces import TracedRun, load_run  # noqa: E402
from twin.cost import CostModel  # noqa: E402
from twin.sim.run import simulate  # noqa: E402


def kind_seconds(spans, steps: int) -> dict[str, float]:
    """Seconds per step spent in each op kind (bwd ops apart), compute stream only."""
    out: dict[str, float] = collections.defaultdict(float)
    for s in spans:
        if s.stream == "compute":
            out[s.kind + (".bwd" if s.phase == "bwd" else "")] += (s.end_us - s.start_us) / 1e6 / steps
    return dict(out)


def kernel_fit(kernels_dir: Path, cluster: str, out: Path) -> Path:
    """The profile `paratwin calibrate` fits to the kernel sweep in ``kernels_dir``."""
    cmd = [sys.executable, "-m", "paratwin.main", "calibrate", f"bench_dir={kernels_dir}",
           f"cluster={cluster}", f"out={out / 'kernels.yaml'}", f"out_dir={out / 'calibrate'}",
           "interference=false", f"name={cluster}_kernel_sweep"]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return out / "kernels.yaml"


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
    runs = [load_run(d) for d in sorted((results / "execute").glob("*")) if d.is_dir()]
    if not runs:
        sys.exit(f"{results} holds no execute/NAME run directory")
    cluster = runs[0].job.cluster.name
    with tempfile.TemporaryDirectory() as tmp:
        names = sys.argv[2:] or [cluster, str(kernel_fit(results / "kernels", cluster, Path(tmp)))]
        profiles = {}
        for n in names:
            path = ROOT / "conf" / "profiles" / f"{n}.yaml" if "/" not in n else Path(n)
            cost = CostModel.load(path)
            if n.endswith("kernels.yaml"):
                profiles["kernel sweep fit"] = cost
                # its closed forms alone: the sweep's shape factors time a swept shape as measured,
                # and some swept GEMM shapes are the replays' own
                profiles["sweep, no shape factors"] = dataclasses.replace(cost, shape_factors={})
            else:
                profiles[n] = cost
        compare(runs, profiles)


if __name__ == "__main__":
    main()
