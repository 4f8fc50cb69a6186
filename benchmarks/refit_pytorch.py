"""The PyTorch half of the suite refitted on its recorded measurements, with and without the
measured time per op kind: no new measurement, so the host's drift between runs favours
neither.

Run: python benchmarks/refit_pytorch.py OUT [OUT ...]
(OUT: an out_dir of `python benchmarks/validate_suite.py --fit-first against=pytorch|both`,
which holds OUT/profile.yaml (the traces fit), OUT/train_pytorch/runs.csv (PyTorch's steps of
the other configurations, with gemm_s .. optimizer_s where they were profiled) and
OUT/validate_pytorch (the suite's PyTorch steps)). For each OUT and each way of fitting
(`steps+kinds`: the runs file as it is; `steps`: its kind columns left out) it runs
`paratwin calibrate runs=... start=OUT/profile.yaml` into OUT/refit/, simulates every suite
run under the fitted profile and prints the suite's figures at world size 2 (median and
largest |error| against the measured median, how many inside the measured p10-p90 band), the
4-rank 3D run's error (information) and the fitted parameters. It writes only under OUT/refit/.
"""

from __future__ import annotations

import csv
import json
import statistics
import subprocess
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omegaconf import OmegaConf  # noqa: E402

from paratwin.config import job_from_cfg  # noqa: E402
from twin.calibrate.runs import KIND_COLUMNS  # noqa: E402
from twin.cost import CostModel  # noqa: E402
from twin.sim.run import simulate  # noqa: E402


def runs_file(out: Path, kinds: bool) -> Path:
    """OUT's runs file, or a copy without its kind columns."""
    src = out / "train_pytorch" / "runs.csv"
    if kinds:
        return src
    rows = list(csv.DictReader(src.open(newline="")))
    keys = [k for k in rows[0] if k not in KIND_COLUMNS]
    dst = out / "refit" / "runs_steps.csv"
    with dst.open("w", newline="") as fh:
        w = csv.DictWriter(fh, keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    return dst


def hold(out: Path, cost: CostModel) -> list[tuple[str, int, float, bool]]:
    """(run, ranks, error, inside the band) of every suite run trained with PyTorch."""
    rows = []
    for res in sorted((out / "validate_pytorch").glob("*/result.json")):
        row = json.loads(res.read_text())
        src = row["sources"].get("pytorch", {})
        if "measured_p50_s" not in src:
            continue
        job = job_from_cfg(OmegaConf.load(res.parent / "pytorch_twin" / "config.yaml"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t = simulate(job, cost).summary.step_time_s
        rows.append((row["name"], row["world_size"], t / src["measured_p50_s"] - 1,
                     src["measured_p10_s"] <= t <= src["measured_p90_s"]))
    return rows


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    outs = list(map(Path, sys.argv[1:]))
    for out in outs:  # every directory checked before anything is fitted or written
        for need in (out / "profile.yaml", out / "train_pytorch" / "runs.csv", out / "validate_pytorch"):
            if not need.exists():
                sys.exit(f"{out} is not a validate_suite.py --fit-first against=pytorch|both "
                         f"out_dir: it has no {need.relative_to(out)}")
    for out in outs:
        (out / "refit").mkdir(exist_ok=True)
        for label, kinds in (("steps+kinds", True), ("steps", False)):
            prof = out / "refit" / f"profile_{label.replace('+', '_')}.yaml"
            rc = subprocess.run([sys.executable, "-m", "paratwin.main", "calibrate",
                                 f"runs={runs_file(out, kinds)}", f"start={out / 'profile.yaml'}",
                                 "folds=0", f"out={prof}", f"out_dir={out / 'refit' / label}",
                                 "force=true", "format=json"], capture_output=True, text=True)
            if rc.returncode:
                lines = rc.stderr.strip().splitlines()
                sys.exit(lines[-1] if lines else f"paratwin calibrate exited {rc.returncode}")
            params = json.loads(rc.stdout)["params"]
            rows = hold(out, CostModel.load(prof))
            w2 = [r for r in rows if r[1] == 2]
            errs = [abs(r[2]) for r in w2]
            info = " ".join(f"{n} {e:+.1%}" for n, w, e, _ in rows if w != 2)
            print(f"{out} {label:<12} median |error| {statistics.median(errs):.1%}, largest "
                  f"{max(errs):.1%}, {sum(r[3] for r in w2)}/{len(w2)} inside the band; {info}")
            print("   " + ", ".join(f"{n.rsplit('-', 1)[0]} {e:+.1%}" for n, w, e, _ in w2))
            print("   " + ", ".join(f"{k} {v:.3g}" for k, v in params.items()), flush=True)


if __name__ == "__main__":
    main()
