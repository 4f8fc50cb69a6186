"""Twin accuracy on this machine: the validation suite at world size 2, its headline figures.

Run: python benchmarks/validate_suite.py [--fit-first] [other paratwin validate overrides]

Runs `paratwin validate` (every paradigm at 2 gloo ranks on the val_small model, 3D at 4 for
information) and prints its table; the last line gives the median absolute step-time error
(target <= 5%), the largest error and how many predictions fall inside the measured p10-p90
band (target: >= 80%).

`--fit-first` (the issue's protocol): this host's multi-process speed drifts by up to 2x
between hours, so the profile is fitted right before the validation, from executed runs of
*other* configurations (val_small at seq_len 128, and at hidden 512 with 8 heads, under
ddp, tp_sp, pp_1f1b, fsdp, tp and zero2: 12 runs, about 2 minutes), with
`paratwin calibrate traces=...` into OUT/profile.yaml, and the suite is validated with it.
Without it, give `calibration=` (default: the cluster's own profile, conf/profiles/cpu_local.yaml).

Against real training too: `python benchmarks/validate_suite.py against=both` also trains
each preset PyTorch has a counterpart for with its own DDP / FSDP2 / DTensor TP-SP /
pipelining (`paratwin conformance`'s ranks), times its steps and holds the twin against them:
a section per source, the step times side by side (twin, replay, PyTorch) and the presets
skipped; `against=pytorch` for real training alone. Every other argument is passed to
`paratwin validate` as it is (`against=`, `suite=[ddp,fsdp]`, `out_dir=` to resume).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

TRAIN_PRESETS = ("ddp", "tp_sp", "pp_1f1b", "fsdp", "tp", "zero2")
TRAIN_MODELS = {"seq128": ["model.seq_len=128"],
                "h512": ["model.hidden_size=512", "model.num_heads=8"]}


def paratwin(*args: str) -> int:
    cmd = [sys.executable, "-m", "paratwin.main", *args]
    print("$ paratwin " + " ".join(args), flush=True)
    return subprocess.run(cmd).returncode


def fit_first(out: Path) -> Path:
    """Execute the training configurations and fit a profile from their traces."""
    dirs = []
    t0 = time.perf_counter()
    for preset in TRAIN_PRESETS:
        for tag, model in TRAIN_MODELS.items():
            d = out / "train" / f"{preset}-{tag}"
            if not (d / "summary.json").exists():
                rc = paratwin("execute", "model=val_small", *model, f"parallel={preset}",
                              "cluster.gpus_per_node=2", "steps=8", "warmup=2", f"out_dir={d}",
                              "report=false", "format=json")
                if rc:
                    sys.exit(rc)
            dirs.append(str(d))
    profile = out / "profile.yaml"
    rc = paratwin("calibrate", f"traces=[{','.join(dirs)}]", f"out={profile}",
                  f"out_dir={out / 'calibrate'}", "force=true")
    if rc:
        sys.exit(rc)
    print(f"fitted from {len(dirs)} executed runs in {time.perf_counter() - t0:.0f} s", flush=True)
    return profile


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--fit-first"]
    if "--fit-first" in sys.argv[1:]:
        given = [a.split("=", 1)[1] for a in args if a.startswith("out_dir=")]
        out = Path(given[0] if given else f"reports/validate_suite/{time.strftime('%Y%m%d-%H%M%S')}")
        profile = fit_first(out)
        args = [a for a in args if not a.startswith(("out_dir=", "calibration="))]
        args += [f"calibration={profile}", f"out_dir={out / 'validate'}"]
    sys.exit(paratwin("validate", "report=false", *args))


if __name__ == "__main__":
    main()
