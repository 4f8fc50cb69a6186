"""Twin accuracy on this machine: the validation suite at world size 2, its headline figures.

Run: python benchmarks/validate_suite.py [calibration=cpu_local] [other paratwin validate overrides]
Runs `paratwin validate` (every paradigm at 2 gloo ranks on the val_small model, 3D at 4 for
information) and prints its table; the last line gives the median absolute step-time error
(target <= 5%), the largest error and how many predictions fall inside the measured p10-p90
band (target: all). Calibrate first: `paratwin calibrate cluster=cpu_local`.

Against real training too: `python benchmarks/validate_suite.py against=both` also trains
each preset PyTorch has a counterpart for with its own DDP / FSDP2 / DTensor TP-SP /
pipelining (`paratwin conformance`'s ranks), times its steps and holds the twin against them:
a section per source, the step times side by side (twin, replay, PyTorch) and the presets
skipped; `against=pytorch` for real training alone. Every argument is passed to
`paratwin validate` as it is (`against=`, `suite=[ddp,fsdp]`, `out_dir=` to resume).
"""

from __future__ import annotations

import subprocess
import sys


def main() -> None:
    args = sys.argv[1:]
    cmd = [sys.executable, "-m", "paratwin.main", "validate", "report=false", *args]
    print("$ paratwin " + " ".join(cmd[3:]), flush=True)
    sys.exit(subprocess.run(cmd).returncode)


if __name__ == "__main__":
    main()
