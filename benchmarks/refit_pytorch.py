"""PyTorch's training steps held against a refit on the same measurements: what a change to the
cost model or its fit does to the held-out figures, with no new measurement (so the host's
drift between runs cannot favour either side).

Run: python benchmarks/refit_pytorch.py SUITE_OUT_DIR NEW_OUT_DIR

SUITE_OUT_DIR: the out_dir of `python benchmarks/validate_suite.py --fit-first against=pytorch`
(or both): its training runs (train_pytorch/runs.csv), the traces-fitted profile they were fitted
from (profile.yaml) and the validated PyTorch runs (validate_pytorch). The training runs are
fitted again with this checkout's `paratwin calibrate runs=...` into NEW_OUT_DIR/profile_pytorch.yaml,
the validated runs are copied to NEW_OUT_DIR/validate_pytorch and predicted again under it
(validate's resume: every measurement kept), and the suite's figures are printed before (as
SUITE_OUT_DIR has them) and after. SUITE_OUT_DIR is only read; NEW_OUT_DIR must be new or empty.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.validate_suite import PYTORCH_PROTOCOL, calibrate_pytorch, paratwin  # noqa: E402


def figures(validate_dir: Path) -> str:
    """Median and largest |error| and runs in band of a validation's PyTorch runs."""
    runs = json.loads((validate_dir / "validate.json").read_text())["runs"]
    errs = {r["name"]: r["error"] for r in runs if r.get("error") is not None}
    inside = sum(bool(r.get("in_band")) for r in runs if r.get("error") is not None)
    worst = max(errs, key=lambda k: abs(errs[k]))
    return (f"median |error| {statistics.median(map(abs, errs.values())):.1%}, largest "
            f"{abs(errs[worst]):.1%} ({worst}), {inside} of {len(errs)} inside the measured band; "
            + ", ".join(f"{k} {v:+.1%}" for k, v in errs.items()))


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    suite, out = Path(sys.argv[1]), Path(sys.argv[2])
    needed = [suite / "train_pytorch" / "runs.csv", suite / "profile.yaml",
              suite / "validate_pytorch" / "validate.json"]
    missing = [str(p) for p in needed if not p.exists()]
    if missing:
        sys.exit(f"{suite} is not a validate_suite --fit-first against=pytorch out_dir: "
                 f"{', '.join(missing)} missing")
    if out.exists() and any(out.iterdir()):  # the refit's profile would replace one there
        sys.exit(f"{out} is not empty: give a new NEW_OUT_DIR (nothing in it is replaced)")
    out.mkdir(parents=True, exist_ok=True)
    shutil.copytree(suite / "validate_pytorch", out / "validate_pytorch")
    profile = calibrate_pytorch(needed[0], needed[1], out)
    rc = paratwin("validate", "report=false", "against=pytorch", *PYTORCH_PROTOCOL,
                  f"calibration={profile}", f"out_dir={out / 'validate_pytorch'}")
    if rc:
        sys.exit(rc)
    print(f"before ({suite}): {figures(suite / 'validate_pytorch')}")
    print(f"after  ({out}): {figures(out / 'validate_pytorch')}")


if __name__ == "__main__":
    main()
