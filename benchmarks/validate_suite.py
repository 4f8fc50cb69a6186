"""Twin accuracy on this machine: the validation suite at world size 2, its headline figures.

Run: python benchmarks/validate_suite.py [--fit-first] [other paratwin validate overrides]

Runs `paratwin validate` (every paradigm at 2 gloo ranks on the val_small model, 3D at 4 for
information) and prints its table; the last line gives the median absolute step-time error
(target <= 5%), the largest error and how many predictions fall inside the measured p10-p90
band (target: >= 80%).

`--fit-first` (the issue's protocol): the profile is fitted from executed runs of *other*
configurations (val_small at seq_len 128, and at hidden 512 with 8 heads, under ddp, tp_sp,
pp_1f1b, fsdp, tp, zero2 and dp: 14 runs), with `paratwin calibrate traces=...` into
OUT/profile.yaml, and the suite is validated with it. This host's multi-process speed drifts
by up to 2x between hours and by tens of percent within one (the same ddp replay measured
216 ms and 278 ms four hours apart), so the fit's runs and the validated runs are measured in
one window, in alternation: for each preset of the suite in turn, its paradigm's training
runs (if it has any), then its validation run (`measure_interleaved`). Only then is the
profile fitted, and `paratwin validate` run again over the same directory: it keeps every
measurement and predicts each run again under the fitted profile (validate's resume). No
validated run is seen by the fit. Without it, give `calibration=` (default: the cluster's
own profile, conf/profiles/cpu_local.yaml).

With `--fit-first against=pytorch|both`, real training follows the same protocol: the other
configurations (but zero2 and dp, which PyTorch has no counterpart for) are trained with
PyTorch's own DDP / FSDP2 / DTensor / pipelining beside their replays, one more step of each
profiled (torch.profiler's time per op kind, written as the runs file's gemm_s ...
optimizer_s), and their step and kind times fitted with `paratwin calibrate runs=...
start=OUT/profile.yaml` (what a real step adds: the framework's cost per op, the eager AdamW)
into OUT/profile_pytorch.yaml, which the suite's PyTorch steps (OUT/validate_pytorch, trained
in the same alternation) are then held against; the replays keep the traces-fitted profile
(OUT/validate). PyTorch's steps, for the fit and the validation, are measured after 4
warm-up steps, 12 of them, and every validation run whose p10-p90 band is wider than 25% of
its median is measured again (at most twice, the narrowest kept: PROTOCOL, PYTORCH_PROTOCOL;
the same fields on the command line replace them).

Against real training too: `python benchmarks/validate_suite.py against=both` also trains
each preset PyTorch has a counterpart for with its own DDP / FSDP2 / DTensor TP-SP /
pipelining (`paratwin conformance`'s ranks), times its steps and holds the twin against them:
a section per source, the step times side by side (twin, replay, PyTorch) and the presets
skipped; `against=pytorch` for real training alone. Every other argument is passed to
`paratwin validate` as it is (`against=`, `suite=[ddp,fsdp]`, `out_dir=` to resume).
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from twin.calibrate.runs import KIND_COLUMNS  # noqa: E402

TRAIN_PRESETS = ("ddp", "tp_sp", "pp_1f1b", "fsdp", "tp", "zero2", "dp")
TRAIN_MODELS = {"seq128": ["model.seq_len=128"],
                "h512": ["model.hidden_size=512", "model.num_heads=8"]}


def paratwin(*args: str) -> int:
    cmd = [sys.executable, "-m", "paratwin.main", *args]
    print("$ paratwin " + " ".join(args), flush=True)
    return subprocess.run(cmd).returncode


def execute_training(out: Path, preset: str) -> list[str]:
    """Execute ``preset``'s training configurations (once: a finished one is kept); their
    run directories."""
    dirs = []
    for tag, model in TRAIN_MODELS.items():
        d = out / "train" / f"{preset}-{tag}"
        if not (d / "summary.json").exists():
            rc = paratwin("execute", "model=val_small", *model, f"parallel={preset}",
                          "cluster.gpus_per_node=2", "steps=8", "warmup=2", f"out_dir={d}",
                          "report=false", "format=json")
            if rc:
                sys.exit(rc)
        dirs.append(str(d))
    return dirs


def fit_traces(out: Path) -> Path:
    """Fit a profile from the executed training runs' traces."""
    dirs = [d for preset in TRAIN_PRESETS for d in execute_training(out, preset)]
    profile = out / "profile.yaml"
    t0 = time.perf_counter()
    rc = paratwin("calibrate", f"traces=[{','.join(dirs)}]", f"out={profile}",
                  f"out_dir={out / 'calibrate'}", "force=true")
    if rc:
        sys.exit(rc)
    print(f"fitted from {len(dirs)} executed runs in {time.perf_counter() - t0:.0f} s", flush=True)
    return profile


PYTORCH_PRESETS = tuple(p for p in TRAIN_PRESETS if p not in ("zero2", "dp"))  # no PyTorch counterpart
PROTOCOL = ("max_spread=0.25", "retries=2")
"""Every validation run (replays and PyTorch's training): a run whose p10-p90 band is wider
than a quarter of its median was disturbed (another tenant took the cores for part of it; a
quiet run's band is 6-20% here) and is measured again, at most twice, the narrowest kept."""
PYTORCH_PROTOCOL = (*PROTOCOL, "warmup=4", "steps=12")
"""PyTorch's training steps, for the fit and the validation alike, also: a real step settles
after 3-5 steps on this host (FSDP2's first steps run 10-50% slower: its buffers and the
caching allocator warm up; validate's default warmup=2 kept two of them), then 12 steps for
the median and the p10-p90 band (6 give a band of their extremes)."""


PYTORCH_FIELDS = tuple(f"{a.split('=', 1)[0]}=" for a in PYTORCH_PROTOCOL)
"""The command line's settings of those fields (``warmup=``, ``steps=``, ...)."""


def protocol(args: list[str], base: tuple[str, ...] = PYTORCH_PROTOCOL) -> list[str]:
    """``base`` with the command line's own settings of the same fields in their place."""
    given = {a.split("=", 1)[0] for a in args}
    return [a for a in base if a.split("=", 1)[0] not in given]


def kind_columns(src: dict, world: int) -> dict[str, float]:
    """A trained run's seconds per step and rank in each fitted kind (the runs file's KIND_s
    columns): torch.profiler's CPU time of the kind over every rank, per rank, scaled from the
    profiled step to the measured median (the profiler's own overhead, largest on DTensor's
    many small ops, stretches the one step it records)."""
    prof = src.get("torch_profile") or {}
    if not prof.get("step_s"):
        return {}
    scale = src["measured_p50_s"] / prof["step_s"]
    return {col: prof["kinds"][kind] / world * scale for col, kind in KIND_COLUMNS.items()
            if prof["kinds"].get(kind, 0) > 0}


def train_pytorch(out: Path, preset: str, measure: list[str]) -> None:
    """Train ``preset``'s other configurations with PyTorch's own DDP / FSDP2 / DTensor /
    pipelining, time their steps and profile one more (the time per op kind); ``measure``:
    the steps measured (warmup=, steps=). A finished one is kept (validate's resume)."""
    for tag, model in TRAIN_MODELS.items():
        rc = paratwin("validate", "report=false", "against=pytorch", "pytorch_profile=true", *measure,
                      f"suite=[{preset}]", "info_suite=[]",
                      "overrides=[" + ",".join(f"'{m}'" for m in model) + "]",
                      f"out_dir={out / 'train_pytorch' / tag}")
        if rc:
            sys.exit(rc)


def fit_pytorch(out: Path, start: Path, measure: list[str]) -> Path:
    """Fit what a real step adds to the replayed schedule (the framework's cost per op, the
    eager optimizer) from the trained configurations' step and kind times with `paratwin
    calibrate runs=...`, starting from the traces-fitted ``start``."""
    t0 = time.perf_counter()
    rows = []
    for tag, model in TRAIN_MODELS.items():
        for preset in PYTORCH_PRESETS:
            done = out / "train_pytorch" / tag / f"{preset}-w2" / "result.json"
            if not done.exists():  # a preset outside the suite: trained now
                train_pytorch(out, preset, measure)
            run = json.loads(done.read_text())
            src = run["sources"].get("pytorch", {})
            if "measured_p50_s" in src:
                rows.append({"name": f"{run['parallel']}-{tag}", "parallel": run["parallel"],
                             **dict(m.split("=", 1) for m in model),
                             "step_time_s": src["measured_p50_s"],
                             **kind_columns(src, run["world_size"])})
    runs = out / "train_pytorch" / "runs.csv"
    keys = ["name", "parallel", *sorted({k for r in rows for k in r} - {"name", "parallel",
                                                                          "step_time_s", *KIND_COLUMNS})]
    with runs.open("w", newline="") as fh:
        w = csv.DictWriter(fh, [*keys, "model", "cluster", "cluster.gpus_per_node",
                                "parallel.sp_norm_grad_sync", "parallel.optimizer_kernels",
                                "step_time_s", *KIND_COLUMNS])
        w.writeheader()
        for r in rows:  # the job conformance trains (validate's pytorch_twin)
            w.writerow({**r, "model": "val_small", "cluster": "cpu_local",
                        "cluster.gpus_per_node": 2, "parallel.sp_norm_grad_sync": "per_tensor",
                        "parallel.optimizer_kernels": "foreach"})
    profile = calibrate_pytorch(runs, start, out)
    print(f"fitted PyTorch's steps from {len(rows)} training runs in {time.perf_counter() - t0:.0f} s",
          flush=True)
    return profile


def calibrate_pytorch(runs: Path, start: Path, out: Path) -> Path:
    """`paratwin calibrate runs=RUNS start=START` into OUT/profile_pytorch.yaml (its run
    directory OUT/calibrate_pytorch); exits with its status when it fails."""
    profile = out / "profile_pytorch.yaml"
    rc = paratwin("calibrate", f"runs={runs}", f"start={start}", "folds=0", f"out={profile}",
                  f"out_dir={out / 'calibrate_pytorch'}", "force=true")
    if rc:
        sys.exit(rc)
    return profile


def suite_of(args: list[str]) -> list[tuple[str, str]]:
    """(field, preset) of every run the validation holds: the command line's suite= and
    info_suite= when given, else conf/validate.yaml's."""
    from omegaconf import OmegaConf

    conf = OmegaConf.load(Path(__file__).resolve().parents[1] / "conf" / "validate.yaml")
    given = {a.split("=", 1)[0]: OmegaConf.from_dotlist([a])[a.split("=", 1)[0]]
             for a in args if a.startswith(("suite=", "info_suite="))}
    return [(field, str(p)) for field in ("suite", "info_suite")
            for p in (given[field] if field in given else conf[field]) or []]


def measure_interleaved(out: Path, args: list[str], against: str, measure: list[str]) -> None:
    """Measure the fit's runs and the validated runs in alternation (module docstring): per
    preset, its paradigm's training runs, then its validation run(s), predicted for now under
    the cluster's own profile (predicted again once the fit is done)."""
    rest = [a for a in args if not a.startswith(("suite=", "info_suite="))]
    plain = [a for a in rest if not a.startswith(PYTORCH_FIELDS)]
    for field, preset in suite_of(args):
        if preset in TRAIN_PRESETS:
            execute_training(out, preset)
        one = [f"{field}=[{preset}]", f"{'info_suite' if field == 'suite' else 'suite'}=[]"]
        if against in ("replay", "both"):
            rc = paratwin("validate", "report=false", "against=replay", *one, *rest,
                          *protocol(rest, PROTOCOL), f"out_dir={out / 'validate'}")
            if rc:
                sys.exit(rc)
        if against in ("pytorch", "both"):
            if preset in PYTORCH_PRESETS:
                train_pytorch(out, preset, measure)
            rc = paratwin("validate", "report=false", "against=pytorch", *one, *plain, *measure,
                          f"out_dir={out / 'validate_pytorch'}")
            if rc:
                sys.exit(rc)


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--fit-first"]
    if "--fit-first" in sys.argv[1:]:
        given = [a.split("=", 1)[1] for a in args if a.startswith("out_dir=")]
        out = Path(given[0] if given else f"reports/validate_suite/{time.strftime('%Y%m%d-%H%M%S')}")
        against = next((a.split("=", 1)[1] for a in args if a.startswith("against=")), "replay")
        args = [a for a in args if not a.startswith(("out_dir=", "calibration=", "against="))]
        measure = protocol(args) + [a for a in args if a.startswith(PYTORCH_FIELDS)]
        t0 = time.perf_counter()
        measure_interleaved(out, args, against, measure)
        print(f"measured the fit's runs and the validated ones in {time.perf_counter() - t0:.0f} s",
              flush=True)
        profile = fit_traces(out)
        rc = 0
        if against in ("replay", "both"):  # every run kept: predicted again under the fit
            rc |= paratwin("validate", "report=false", "against=replay", *args, *protocol(args, PROTOCOL),
                           f"calibration={profile}", f"out_dir={out / 'validate'}")
        if against in ("pytorch", "both"):
            # a real step is a different program from the replay: its own fit, same protocol
            rest = [a for a in args if not a.startswith(PYTORCH_FIELDS)]
            rc |= paratwin("validate", "report=false", "against=pytorch", *rest, *measure,
                           f"calibration={fit_pytorch(out, profile, measure)}",
                           f"out_dir={out / 'validate_pytorch'}")
        sys.exit(rc)
    sys.exit(paratwin("validate", "report=false", *args))


if __name__ == "__main__":
    main()
