"""`paratwin validate`: run a suite of schedules for real and hold the twin's predictions against them.

For each parallel preset of the suite: `paratwin execute` runs it (steps after warm-up;
median and p10-p90 over steps), the twin simulates the same job with the calibration
profile, and the two are compared: step-time error, whether the prediction falls inside
the measured band, and per-op-kind errors over the ops both traces hold (same op ids).
Results land in OUT_DIR/NAME/ (execute/, twin/, result.json, report.html) and
OUT_DIR/validate.json; finished runs are kept when the suite is run again (resume).
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import time
from pathlib import Path

from hydra import compose

from paratwin.config import CONF_DIR, job_from_cfg, load_profile
from paratwin.outdir import out_dir
from paratwin.verbs import execute
from twin import rundir
from twin.files import write_json_atomic
from twin.sim.run import simulate
from twin.spec import ConfigError
from twin.trace import Trace
from twin.validate import compare, kind_errors, suite_figures


def _passthrough() -> tuple[str, str, list[str]]:
    """The model and cluster choices and the user's model./cluster. overrides."""
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    keep = [o for o in hc.overrides.task if o.lstrip("+~").startswith(("model.", "cluster."))]
    return hc.runtime.choices["model"], hc.runtime.choices["cluster"], keep


def run_one(name: str, preset: str, world: int, cfg, out: Path, passthrough) -> dict:
    done = out / name / "result.json"
    if cfg.get("resume", True) and done.exists():
        return json.loads(done.read_text())
    model, cluster, extra = passthrough
    exec_dir, twin_dir = out / name / "execute", out / name / "twin"
    args = [f"model={model}", f"cluster={cluster}", f"parallel={preset}",
            f"cluster.gpus_per_node={world}", f"steps={cfg.steps}", f"warmup={cfg.warmup}",
            f"timeout_s={cfg.timeout_s}", f"out_dir={exec_dir}", "format=json", "report=false",
            *extra, *list(cfg.get("overrides") or [])]
    ecfg = compose(config_name="execute", overrides=args)  # this app's config tree
    t0 = time.perf_counter()
    said = io.StringIO()
    try:  # the execute verb in this process; its printout is not validate's
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(said):
            execute.run(ecfg)
    except SystemExit as err:
        if isinstance(err.code, int) and err.code >= 128:  # interrupted: end validate the same way
            raise
        raise ConfigError(f"validate {name}: paratwin execute failed (exit {err.code}): "
                          f"{(said.getvalue().strip().splitlines() or ['no output'])[-1]}") from None
    except ConfigError as err:
        raise ConfigError(f"validate {name}: {err}") from None
    measured = json.loads((exec_dir / "summary.json").read_text())
    job = job_from_cfg(ecfg)
    cost = load_profile(cfg.get("calibration"), job.cluster)
    res = simulate(job, cost)
    rundir.claim(twin_dir, "simulate", bool(cfg.get("force", False)))
    res.trace.save(twin_dir / rundir.TRACE)
    rundir.write_json(twin_dir / rundir.SUMMARY, res.summary.to_dict())
    (twin_dir / rundir.CONFIG).write_text((exec_dir / rundir.CONFIG).read_text())
    row = {"name": name, "parallel": preset, "world_size": world,
           **compare(measured, res.summary),
           "kinds": kind_errors(Trace.load(exec_dir / "spans.json"), res.trace),
           "profile": cost.name, "wall_s": time.perf_counter() - t0}
    if cfg.get("report", True):
        try:
            from twin.report import write_report

            write_report([exec_dir, twin_dir], out=out / name / "report.html")
        except Exception as err:  # the figures are a bonus: a report failure keeps the result
            row["report_error"] = f"{type(err).__name__}: {err}"
    write_json_atomic(done, row)
    return row


def worst_kinds(row: dict, n: int = 2) -> str:
    kinds = [(k, v) for k, v in row["kinds"].items() if not k.startswith("_") and v["error"] is not None
             and v["measured_s"] > 0.02 * row["measured_p50_s"] * row["world_size"]]
    kinds.sort(key=lambda kv: -abs(kv[1]["error"]))
    return ", ".join(f"{k} {v['error']:+.0%}" for k, v in kinds[:n])


def format_table(rows: list[dict], info: list[dict], figures: dict) -> str:
    head = (f"{'run':<15} {'ranks':>5} {'measured p50 (p10-p90) ms':>27} {'twin ms':>9} {'error':>7} "
            f"{'band':>5}  largest per-kind errors")
    lines = [head]
    for r in rows + info:
        band = f"{r['measured_p10_s'] * 1e3:.1f}-{r['measured_p90_s'] * 1e3:.1f}"
        lines.append(f"{r['name']:<15} {r['world_size']:>5} {r['measured_p50_s'] * 1e3:>9.1f} "
                     f"({band:>15}) {r['predicted_s'] * 1e3:>9.1f} {r['error']:>+7.1%} "
                     f"{'yes' if r['in_band'] else 'no':>5}  {worst_kinds(r)}"
                     + ("   (information)" if r in info else ""))
    f = figures
    if f["runs"]:
        lines.append(f"\n{f['runs']} runs at world size {rows[0]['world_size']}: median |error| "
                     f"{f['median_abs_error']:.1%}, largest {f['max_abs_error']:.1%} ({f['worst']}), "
                     f"{f['in_band']}/{f['runs']} predictions inside the measured p10-p90 band")
    return "\n".join(lines)


def run(cfg) -> dict:
    fmt = cfg.get("format", "text")
    if fmt not in ("text", "json"):
        raise ConfigError(f"format={fmt!r} is not one of text|json")
    if cfg.get("runs"):  # a file of measured runs (the user's own logs), nothing executed
        from paratwin.fitruns import format_validation, validate_runs

        def claim() -> Path:
            return rundir.claim(out_dir(cfg, "validate"), "validate", bool(cfg.get("force", False)))

        report = validate_runs(cfg, claim, load_profile)
        if cfg.get("report", True):
            from twin.report import write_report

            write_report([report["out_dir"]])
        print(json.dumps(report, indent=2, default=float) if fmt == "json"
              else format_validation(report))
        return report
    presets = sorted(p.stem for p in (CONF_DIR / "parallel")
                     .glob("*.yaml"))
    suite = list(cfg.get("suite") or [])
    info = list(cfg.get("info_suite") or [])
    bad = [p for p in suite + info if p not in presets]
    if bad:
        raise ConfigError(f"suite has unknown parallel presets {bad}; choose among {', '.join(presets)}")
    out = rundir.claim(out_dir(cfg, "validate"), "validate", bool(cfg.get("force", False)))
    passthrough = _passthrough()
    rows, info_rows = [], []
    plan = [(p, int(cfg.world_size), rows) for p in suite] + \
        [(p, int(cfg.info_world_size), info_rows) for p in info]
    for k, (preset, world, into) in enumerate(plan, start=1):
        print(f"[{k}/{len(plan)}] {preset} at {world} ranks ...", file=sys.stderr, flush=True)
        into.append(run_one(f"{preset}-w{world}", preset, world, cfg, out, passthrough))
    figures = suite_figures(rows)
    result = {"figures": figures, "runs": rows, "information": info_rows, "out_dir": str(out)}
    write_json_atomic(out / "validate.json", result)
    print(json.dumps(result, indent=2) if fmt == "json" else format_table(rows, info_rows, figures))
    return result
