"""`paratwin calibrate runs=FILE`: the cost model fitted to measured step times of whole runs.

Every row of the runs file becomes a job (``paratwin.runs``) before anything is fitted; a
bad row stops the verb in one line and nothing is written. Collectives come from
nccl-tests outputs (``nccl_tests=``) or keep the base profile's. The fit
(``twin.calibrate.stepfit``) is cross-validated first: k folds (``folds=``) or a named
hold-out (``holdout=model.hidden_size==2048``), each row predicted by the full simulator
under a fit that never saw it, with the figures a user choosing a plan needs
(``twin.calibrate.accuracy``). Then the fit on every row is written as the profile.
"""

from __future__ import annotations

import csv
import dataclasses
import glob
import io
import operator
import re
import sys
from pathlib import Path

from paratwin.config import load_profile
from paratwin.runs import RunJob, column_map, jobs_from_runs
from twin import rundir
from twin.calibrate.accuracy import Scored, holdout, kfold, score
from twin.calibrate.kindtime import kind_errors
from twin.calibrate.nccl_tests import NcclTestsError, read_nccl_tests
from twin.calibrate.profile import fit_collectives
from twin.calibrate.stepfit import fit_start, fit_steps, predict
from twin.files import write_text_atomic
from twin.spec import ConfigError

COLUMNS = ["line", "name", "model", "measured_s", "predicted_s", "error", "split"]
_OPS = {"==": operator.eq, "!=": operator.ne, "<=": operator.le, ">=": operator.ge,
        "<": operator.lt, ">": operator.gt}


def holdout_test(expr: str):
    """``KEY OP VALUE`` (``model.hidden_size==2048``) as a test of a RunJob."""
    m = re.fullmatch(r"\s*([A-Za-z_][\w.]*)\s*(==|!=|<=|>=|<|>)\s*(\S+)\s*", str(expr))
    if not m:
        raise ConfigError(f"holdout={expr!r} must be KEY OP VALUE, e.g. holdout=model.hidden_size==2048")
    key, op, raw = m.groups()
    try:
        value = float(raw)
    except ValueError:
        value = raw

    def test(rj: RunJob) -> bool:
        obj = rj.job
        for part in key.split("."):
            if not hasattr(obj, part):
                raise ConfigError(f"holdout={expr!r}: the jobs have no field {key}")
            obj = getattr(obj, part)
        try:
            return bool(_OPS[op](float(obj) if isinstance(value, float) else str(obj), value))
        except (TypeError, ValueError):
            return False

    return test


def expand_paths(spec, key: str, what: str = "file") -> list[Path]:
    """Paths named by ``key=``: a list, or a string of comma-separated items, each a path or
    a glob pattern; a pattern that matches nothing is an error naming it."""
    items = str(spec).split(",") if isinstance(spec, str) else list(spec or [])
    out: list[Path] = []
    for item in (str(i).strip() for i in items):
        if not item:
            continue
        if not glob.has_magic(item):
            if not Path(item).exists():
                raise ConfigError(f"{key}: {item} does not exist; give an existing {what}")
            hits = [item]
        elif not (hits := sorted(glob.glob(item))):
            raise ConfigError(f"{key}: {item} matches no {what}")
        out += [Path(h) for h in hits]
    return out


def nccl_files(spec) -> list[Path]:
    """Files named by ``nccl_tests=`` (paths or glob patterns)."""
    return expand_paths(spec, "nccl_tests")


def _model(job) -> str:
    return f"{job.model.name} h{job.model.hidden_size} L{job.model.num_layers}"


def _group(job) -> tuple:
    return (_model(job), job.grid.world_size, job.parallel.global_batch_size)


def fit_from_runs(cfg, path_for, claim) -> dict:
    """The runs workflow (see the module docstring); ``path_for(cluster)`` says where the
    profile goes and ``claim()`` makes the run directory, both once every row has become a
    job (a bad row writes nothing). Returns what format=json prints."""
    ceiling = cfg.get("gemm_ceiling")
    if ceiling is not None and not (isinstance(ceiling, (int, float)) and 0 < ceiling <= 1):
        raise ConfigError(f"gemm_ceiling={ceiling!r} must be a fraction of peak in (0, 1] (the "
                          "GPU's maximum achievable matmul FLOP/s over its peak, e.g. 0.869 on "
                          "A100 SXM), or null to fit the GEMMs' efficiency")
    rows = jobs_from_runs(str(cfg.runs), column_map(cfg.get("runs_columns")))
    clusters = {r.job.cluster.name for r in rows}
    if len(clusters) > 1:
        raise ConfigError(f"runs={cfg.runs} mixes clusters {sorted(clusters)}; a profile describes "
                          "one: split the file")
    cluster = rows[0].job.cluster
    profile_path, name = path_for(cluster)
    run_dir = claim()
    base = load_profile(cfg.get("start"), cluster)  # None: the published defaults
    files = nccl_files(cfg.get("nccl_tests"))
    if files:
        try:
            points = [p for f in files for p in read_nccl_tests(f)]
        except NcclTestsError as err:
            raise ConfigError(str(err)) from None
        base = dataclasses.replace(base, collective_fits=fit_collectives(points)[0])
    sync = cfg.get("p2p_host_sync")
    start = fit_start(base, cluster.gpu.sm_count, None if sync is None else bool(sync),
                      shared_cpu=cluster.intra.kind == "shared_cpu")
    workers = int(cfg.get("workers") or 2)
    shapes = cfg.get("shapes")

    def say(message: str) -> None:
        print(f"paratwin calibrate: {message}", file=sys.stderr, flush=True)

    def fit(subset: list[RunJob]):
        return fit_steps([r.job for r in subset], [r.run.step_time_s for r in subset], start,
                         workers=workers, log=lambda m: say("  " + m),
                         shapes=None if shapes is None else bool(shapes),
                         gemm_ceiling=None if ceiling is None else float(ceiling),
                         kinds=[r.run.kinds for r in subset], keep=base)

    preds: dict[int, tuple[float, str]] = {}
    splits: list[tuple[list[int], list[int], str]] = []
    if cfg.get("holdout"):
        tr, te = holdout(rows, holdout_test(str(cfg.holdout)))
        splits.append((tr, te, f"holdout {cfg.holdout}"))
    elif int(cfg.get("folds") or 0) > 1:
        k = int(cfg.folds)
        for j, test in enumerate(kfold(len(rows), k, seed=0)):
            t = set(test.tolist())
            splits.append(([i for i in range(len(rows)) if i not in t], sorted(t), f"fold {j + 1}/{k}"))
    for tr, te, label in splits:
        say(f"{label}: fitting on {len(tr)} rows, predicting {len(te)} ...")
        fitted = fit([rows[i] for i in tr])
        for i, p in zip(te, predict([rows[i].job for i in te], fitted.cost, workers)):
            preds[i] = (p.step_s, label)
    held = None
    if preds:
        held = score([Scored(_model(rows[i].job), _group(rows[i].job), rows[i].run.step_time_s, t)
                      for i, (t, _) in sorted(preds.items())])
    say(f"fitting on all {len(rows)} rows ...")
    final = fit(rows)
    if final.unexercised:
        say(f"no run's step depends on {', '.join(final.unexercised)}: not measured, kept as "
            f"{base.name} has them")
    cpu = cluster.intra.kind == "shared_cpu"  # gloo ranks on CPU cores: no GPUs
    prov = {"source": f"measured runs {cfg.runs}", "cluster": cluster.name,
            "gpus": [] if cpu else [cluster.gpu.name], "backend": "gloo" if cpu else "nccl",
            "start": base.name, "rows": len(rows), "fit_seconds": round(final.seconds, 1),
            "nccl_tests": [str(f) for f in files]}
    if held:
        prov["held_out"] = {k: held[k] for k in ("rows", "mean_abs_error", "median_abs_error",
                                                 "max_abs_error", "spearman_min", "regret_mean")}
    profile = dataclasses.replace(final.cost, name=name, provenance=prov)
    profile_path.parent.mkdir(parents=True, exist_ok=True)
    profile.save(profile_path)
    profile.save(run_dir / rundir.PROFILE)
    measured = [r for r in rows if r.run.kinds]  # in-sample: how the kinds were met
    report = {"profile": str(profile_path), "run_dir": str(run_dir), "rows": len(rows),
              "params": final.params, "unexercised": final.unexercised,
              "rounds": final.rounds, "fit_seconds": final.seconds, "held_out": held,
              "kinds": kind_errors([r.job for r in measured], [r.run.kinds for r in measured],
                                   final.cost)}
    rundir.write_json(run_dir / rundir.FITS, report)
    write_runs_table(run_dir, rows, preds)
    return report


def write_runs_table(run_dir: Path, rows: list[RunJob], preds: dict[int, tuple[float, str]]) -> Path:
    """runs_modelled.csv: each row measured and predicted (by a fit that never saw it)."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS)
    w.writeheader()
    for i, r in enumerate(rows):
        t, label = preds.get(i, (None, ""))
        w.writerow({"line": r.run.line, "name": r.run.name, "model": _model(r.job),
                    "measured_s": r.run.step_time_s, "predicted_s": "" if t is None else t,
                    "error": "" if t is None else t / r.run.step_time_s - 1, "split": label})
    return write_text_atomic(run_dir / rundir.RUNS_MODELLED, buf.getvalue())


def validate_runs(cfg, claim, load_profile) -> dict:
    """`paratwin validate runs=FILE`: the twin (profile ``calibration=``) against every row."""
    rows = jobs_from_runs(str(cfg.runs), column_map(cfg.get("runs_columns")))
    profiles: dict[str, object] = {}
    for r in rows:
        if r.job.cluster.name not in profiles:
            profiles[r.job.cluster.name] = load_profile(cfg.get("calibration"), r.job.cluster)
    run_dir = claim()
    preds: dict[int, tuple[float, str]] = {}
    workers = int(cfg.get("workers") or 2)
    for name, cost in profiles.items():
        idx = [i for i, r in enumerate(rows) if r.job.cluster.name == name]
        for i, p in zip(idx, predict([rows[i].job for i in idx], cost, workers)):
            preds[i] = (p.step_s, "")
    result = score([Scored(_model(r.job), _group(r.job), r.run.step_time_s, preds[i][0])
                    for i, r in enumerate(rows)])
    write_runs_table(run_dir, rows, preds)
    kinds = {}
    for name, cost in profiles.items():  # the runs that measured time per op kind
        sub = [r for r in rows if r.job.cluster.name == name and r.run.kinds]
        kinds.update(kind_errors([r.job for r in sub], [r.run.kinds for r in sub], cost))
    report = {"runs": str(cfg.runs), "rows": len(rows), "out_dir": str(run_dir),
              "profiles": {k: getattr(v, "name", "") for k, v in profiles.items()}, **result,
              "kinds": kinds}
    rundir.write_json(run_dir / "validate.json", report)
    return report


def format_validation(report: dict) -> str:
    lines = [f"{report['rows']} measured runs ({report['runs']}) against the twin "
             f"(profile {', '.join(report['profiles'].values())}):",
             f"  mean |error| {_pct(report['mean_abs_error'])}, median "
             f"{_pct(report['median_abs_error'])}, largest {_pct(report['max_abs_error'])}; "
             f"{report['too_fast']} of {report['rows']} predicted too fast",
             f"  Spearman per model: min {_num(report['spearman_min'])}, median "
             f"{_num(report['spearman_median'])}; top-1 regret over {report['groups']} plan "
             f"groups: mean {_pct(report['regret_mean'])}, largest {_pct(report['regret_max'])}",
             *([_kinds_line("  time per op kind, |error| median / largest: ", report["kinds"])]
               if report.get("kinds") else []),
             f"  {report['out_dir']}: validate.json, runs_modelled.csv, report.html"]
    return "\n".join(lines)


def _kinds_line(head: str, kinds: dict) -> str:
    return head + ", ".join(f"{k} {_pct(v['median_abs_error'])} / {_pct(v['max_abs_error'])} "
                            f"({v['rows']} runs)" for k, v in kinds.items())


def _pct(x) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def _num(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def format_report(report: dict) -> str:
    lines = [f"profile -> {report['profile']} (fitted on {report['rows']} runs in "
             f"{report['fit_seconds']:.0f} s)"]
    h = report.get("held_out")
    if h:
        lines.append(f"held out ({h['rows']} rows, each predicted by a fit that never saw it): "
                     f"mean |error| {_pct(h['mean_abs_error'])}, median "
                     f"{_pct(h['median_abs_error'])}, largest {_pct(h['max_abs_error'])}; Spearman "
                     f"per model min {_num(h['spearman_min'])}, median {_num(h['spearman_median'])}; "
                     f"top-1 regret mean {_pct(h['regret_mean'])}, largest {_pct(h['regret_max'])}")
    lines.append("parameters: " + ", ".join(f"{k} {v:.3g}" for k, v in report["params"].items()))
    if report.get("kinds"):
        lines.append(_kinds_line("time per op kind, fitted |error| median / largest: ", report["kinds"]))
    return "\n".join(lines)
