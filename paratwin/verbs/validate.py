"""`paratwin validate`: run a suite of schedules for real and hold the twin's predictions against them.

For each parallel preset of the suite: `paratwin execute` runs it (steps after warm-up;
median and p10-p90 over steps), the twin simulates the same job with the calibration
profile, and the two are compared: step-time error, whether the prediction falls inside
the measured band, and per-op-kind errors over the ops both traces hold (same op ids).
Results land in OUT_DIR/NAME/ (execute/, twin/, result.json, report.html) and
OUT_DIR/validate.json; finished runs are kept when the suite is run again (resume): their
measurements as they are, and the twin's side simulated again when ``calibration`` names
another profile than the one they were predicted with (measure once, validate any profile).
With
``max_spread`` a run whose p10-p90 band is wider than that fraction of its median (a noisy
host) is measured again, up to ``retries`` times (NAME/execute.retryK, NAME/pytorch.retryK),
and the narrowest kept; every attempt is listed under ``attempts``.

``against=pytorch`` (or ``both``) also holds the twin against real training: each preset
PyTorch has a counterpart for (executor.conformance.parallelize.check_plan) is trained by
`paratwin conformance`'s ranks (DDP / FSDP2 / DTensor TP-SP / pipelining on the Llama-style
model of the ModelSpec), each step timed on every rank without a barrier (the step's time:
the largest rank's), and one more step profiled for CPU time per op kind; the twin predicts
the same job (conformance's schedule options) as it stands, nothing added for the framework.
Each row keeps every source's figures under ``sources`` (OUT_DIR/NAME/pytorch/,
pytorch_twin/); its top-level figures are its first source's; presets without a
counterpart are listed under ``skipped`` with the reason.
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
from twin.spec.errors import check_choice
from twin.trace import Trace
from twin.validate import (
    compare,
    kept_summary,
    kind_errors,
    profile_id,
    profile_kind_errors,
    source_rows,
    steadiest,
    suite_figures,
)


def _passthrough() -> tuple[str, str, list[str]]:
    """The model and cluster choices and the user's model./cluster. overrides."""
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    keep = [o for o in hc.overrides.task if o.lstrip("+~").startswith(("model.", "cluster."))]
    return hc.runtime.choices["model"], hc.runtime.choices["cluster"], keep


SOURCES = {"replay": ("replay",), "pytorch": ("pytorch",), "both": ("replay", "pytorch")}
FIGURES = ("measured_p50_s", "measured_p10_s", "measured_p90_s", "predicted_s", "error", "in_band",
           "kinds", "profile", "profile_id", "wall_s", "report_error")
"""A source's figures that a row also carries at its top level (its first source's)."""
TITLES = {"replay": "against the replay (paratwin execute runs the schedule)",
          "pytorch": "against PyTorch (its DDP / FSDP2 / DTensor TP-SP / pipelining train the model)"}


def _group_overrides(cfg) -> list[str]:
    return [o for o in list(cfg.get("overrides") or [])
            if o.lstrip("+~").startswith(("model.", "cluster.", "parallel."))]


def _steadiest(name: str, measure, first: Path, cfg):
    """``twin.validate.steadiest`` under the config's ``max_spread`` and ``retries``."""
    limit = cfg.get("max_spread")
    return steadiest(measure, first, None if limit is None else float(limit),
                     int(cfg.get("retries", 2)),
                     log=lambda m: print(f"paratwin validate: {name}: {m}", file=sys.stderr, flush=True))


def _execute(name: str, ecfg, where: Path) -> dict:
    """`paratwin execute` the preset into ``where``; its summary."""
    ecfg.out_dir = str(where)
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
    return json.loads((where / "summary.json").read_text())


def run_replay(name: str, ecfg, cfg, out: Path, kept: dict | None = None) -> dict:
    """`paratwin execute` the preset (again while its band is too wide: ``max_spread``),
    simulate it, compare: the replay's figures. ``kept``: figures of a finished measurement
    (resume under another profile): nothing is executed, the twin's side is made again."""
    twin_dir = out / name / "twin"
    t0 = time.perf_counter()
    first = Path(str(ecfg.out_dir))
    if kept is None:
        exec_dir, measured, attempts = _steadiest(name, lambda d: _execute(name, ecfg, d), first, cfg)
    else:
        exec_dir, measured, attempts = (first.with_name(kept["measured_dir"]), kept_summary(kept),
                                         kept["attempts"])
        if not (exec_dir / "spans.json").is_file():
            raise ConfigError(f"validate {name}: its kept measurement {exec_dir} is gone, so it "
                              "cannot be predicted again under this profile; give resume=false "
                              "to measure it again")
    job = job_from_cfg(ecfg)
    cost = load_profile(cfg.get("calibration"), job.cluster)
    res = _simulate(job, cost, twin_dir, cfg, (exec_dir / rundir.CONFIG).read_text())
    real = Trace.load(exec_dir / "spans.json")
    fig = {**compare(measured, res.summary),
           "kinds": kind_errors(real, res.trace),
           "profile": cost.name, "profile_id": profile_id(cost),
           "wall_s": time.perf_counter() - t0 if kept is None else kept["wall_s"],
           "attempts": attempts, "measured_dir": exec_dir.name}
    if cfg.get("report", True):
        try:
            from twin.report import write_report

            write_report([exec_dir, twin_dir], out=out / name / "report.html",
                         traces={exec_dir: real, twin_dir: res.trace.as_saved()})
        except Exception as err:  # the figures are a bonus: a report failure keeps the result
            fig["report_error"] = f"{type(err).__name__}: {err}"
    return fig


def _simulate(job, cost, twin_dir: Path, cfg, config_text: str):
    res = simulate(job, cost)
    rundir.claim(twin_dir, "simulate", bool(cfg.get("force", False)))
    res.trace.save(twin_dir / rundir.TRACE)
    rundir.write_json(twin_dir / rundir.SUMMARY, res.summary.to_dict())
    (twin_dir / rundir.CONFIG).write_text(config_text)
    return res


def run_pytorch(name: str, preset: str, world: int, cfg, out: Path, passthrough,
                threads: int, kept: dict | None = None) -> dict:
    """Train the preset with PyTorch's own APIs (conformance), time its steps, simulate the
    same job (conformance's config: its schedule options), compare; or ``{"skipped": why}``.
    ``kept``: figures of a finished training run (resume under another profile): nothing is
    trained, the twin's side is made again."""
    from omegaconf import OmegaConf

    from executor.conformance.model import check_model
    from executor.conformance.parallelize import check_plan
    from executor.conformance.runner import conform
    from executor.launch import Interrupted, LaunchError

    model, cluster, extra = passthrough
    ccfg = compose(config_name="conformance", overrides=[
        f"model={model}", f"cluster={cluster}", f"parallel={preset}",
        f"cluster.gpus_per_node={world}", *extra, *_group_overrides(cfg)])
    job = job_from_cfg(ccfg)
    try:
        check_model(job.model)
        check_plan(job)
    except ConfigError as err:
        return {"skipped": str(err)}
    if world > 8:
        return {"skipped": f"{world} ranks: conformance runs at most 8"}
    profile = bool(cfg.get("pytorch_profile", True))
    warmup, measured = int(cfg.warmup), int(cfg.steps)
    t0 = time.perf_counter()
    runs: dict[Path, dict] = {}

    def train(where: Path) -> dict:
        try:
            res = runs[where] = conform(
                job, where, steps=warmup + measured + int(profile), warmup=warmup,
                profile=profile, reference=False, timeout_s=float(cfg.timeout_s),
                threads=threads, log=lambda m: print(f"paratwin validate: {name}: {m}",
                                                     file=sys.stderr))
        except Interrupted as err:
            sys.exit(128 + err.signum)
        except (LaunchError, RuntimeError) as err:
            raise ConfigError(f"validate {name}: PyTorch training failed: "
                              f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") \
                from None
        return res["timing"]

    cost = load_profile(cfg.get("calibration"), job.cluster)
    if kept is not None:  # the kept training's figures, the twin's side made again
        sim = _simulate(job, cost, out / name / "pytorch_twin", cfg, OmegaConf.to_yaml(ccfg))
        prof = kept.get("torch_profile")
        return {**kept, **compare(kept_summary(kept), sim.summary),
                "kinds": _pytorch_kinds(prof, sim, job, cost), "profile": cost.name,
                "profile_id": profile_id(cost)}
    where, timing, attempts = _steadiest(name, train, out / name / "pytorch", cfg)
    res = runs[where]
    sim = _simulate(job, cost, out / name / "pytorch_twin", cfg, OmegaConf.to_yaml(ccfg))
    prof = timing["profile"]
    return {**compare(timing, sim.summary), "kinds": _pytorch_kinds(prof, sim, job, cost),
            "profile": cost.name, "profile_id": profile_id(cost),
            "wall_s": time.perf_counter() - t0,
            "steps": timing["measured_steps"], "warmup": warmup,
            "step_times_s": timing["step_times_s"], "per_rank_median_s": timing["per_rank_median_s"],
            "torch_profile": prof, "attempts": attempts, "measured_dir": where.name,
            "conformance": {"plan": res["plan"], "differences": len(res["differences"]),
                            "documented": len(res["documented"])}}


def _pytorch_kinds(prof: dict | None, sim, job, cost) -> dict:
    """torch.profiler's time per kind against the twin's (nothing without a profiled step)."""
    from twin.calibrate.kindtime import kind_seconds

    if not prof:
        return {}
    return profile_kind_errors(prof["kinds"], sim.trace, {
        k: v * job.grid.world_size for k, v in kind_seconds(job, cost).items()})


def _promote(row: dict, order: tuple[str, ...]) -> None:
    """Copy the first of ``order``'s sources with figures to the row's top level (none when
    every one skipped the preset: the row is then only listed as skipped)."""
    for key in FIGURES:
        row.pop(key, None)
    srcs = row["sources"]
    first = next((s for s in order if "error" in srcs.get(s, {})), None)
    if first is not None:
        row.update({k: v for k, v in srcs[first].items() if k in FIGURES})
    row["against"] = [s for s in SOURCES["both"] if s in srcs]


def run_one(name: str, preset: str, world: int, cfg, out: Path, passthrough,
            sources: tuple[str, ...] = ("replay",)) -> dict:
    """One preset against each source; a source already in OUT/NAME/result.json is kept."""
    done = out / name / "result.json"
    row = json.loads(done.read_text()) if cfg.get("resume", True) and done.exists() else None
    if row is not None:
        row.setdefault("sources", {"replay": {k: row[k] for k in FIGURES if k in row}})
    row = row or {"name": name, "parallel": preset, "world_size": world, "sources": {}}
    model, cluster, extra = passthrough
    ecfg, wanted = None, None  # the execute config, the calibration's profile_id: when needed
    for src in sources:
        kept = row["sources"].get(src)
        if kept is not None and ("profile_id" not in kept or "error" not in kept):
            continue  # skipped, or written before profiles were told apart: kept as it is
        if ecfg is None:
            ecfg = compose(config_name="execute", overrides=[  # this app's config tree
                f"model={model}", f"cluster={cluster}", f"parallel={preset}",
                f"cluster.gpus_per_node={world}", f"steps={cfg.steps}", f"warmup={cfg.warmup}",
                f"timeout_s={cfg.timeout_s}", f"out_dir={out / name / 'execute'}", "format=json",
                "report=false", *extra, *list(cfg.get("overrides") or [])])
            wanted = profile_id(load_profile(cfg.get("calibration"), job_from_cfg(ecfg).cluster))
        if kept is not None and kept["profile_id"] == wanted:
            continue
        row["sources"][src] = run_replay(name, ecfg, cfg, out, kept) if src == "replay" else \
            run_pytorch(name, preset, world, cfg, out, passthrough, int(ecfg.get("threads", 1)), kept)
        _promote(row, sources)
        done.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(done, row)
    _promote(row, sources)
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


def format_result(result: dict) -> str:
    """The replay's table as ever with against=replay; else a section per source, the step
    times side by side, and the presets a source skipped."""
    against = result.get("against", "replay")
    if against == "replay":
        return format_table(result["runs"], result["information"], result["figures"])
    sections = []
    for src in SOURCES[against]:
        rows, info = source_rows(result["runs"], src), source_rows(result["information"], src)
        if rows or info:
            sections.append(f"{TITLES[src]}:\n" + format_table(rows, info, result["sources"][src]))
    if against == "both":
        lines = [f"{'step time ms':<18} {'twin':>9} {'replay':>9} {'PyTorch':>9} "
                 f"{'twin vs PyTorch':>16}"]
        for r in result["runs"] + result["information"]:
            rp, pt = r["sources"].get("replay", {}), r["sources"].get("pytorch", {})
            twin = pt.get("predicted_s", rp.get("predicted_s"))
            cells = [f"{v * 1e3:>9.1f}" if v is not None else f"{'-':>9}"
                     for v in (twin, rp.get("measured_p50_s"), pt.get("measured_p50_s"))]
            ratio = f"{pt['error']:>+16.1%}" if "error" in pt else f"{'skipped':>16}"
            lines.append(f"{r['name']:<18} {' '.join(cells)} {ratio}")
        sections.append("\n".join(lines))
    if result["skipped"]:
        sections.append("skipped:\n" + "\n".join(
            f"  {s['name']} ({s['source']}): {s['reason']}" for s in result["skipped"]))
    return "\n\n".join(sections)


def run(cfg) -> dict:
    fmt = cfg.get("format", "text")
    problems: list[str] = []
    check_choice(problems, "format", fmt, ("text", "json"))
    check_choice(problems, "against", cfg.get("against", "replay"), tuple(SOURCES))
    limit, retries = cfg.get("max_spread"), cfg.get("retries", 2)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float))
                              or limit <= 0):
        problems.append(f"max_spread={limit!r} must be a positive fraction of the median (e.g. "
                        "0.25) or null")
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        problems.append(f"retries={retries!r} must be a whole number >= 0")
    if problems:
        raise ConfigError(problems)
    against = cfg.get("against", "replay")
    if cfg.get("runs"):  # a file of measured runs (the user's own logs), nothing executed
        if against != "replay":
            raise ConfigError(f"against={against} trains the suite; runs= holds measured rows "
                              "against the twin without running anything: drop one of them")
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
    rows, info_rows, skipped = [], [], []
    sources = SOURCES[against]
    plan = [(p, int(cfg.world_size), rows) for p in suite] + \
        [(p, int(cfg.info_world_size), info_rows) for p in info]
    for k, (preset, world, into) in enumerate(plan, start=1):
        print(f"[{k}/{len(plan)}] {preset} at {world} ranks"
              + ("" if against == "replay" else f" against {' and '.join(sources)}") + " ...",
              file=sys.stderr, flush=True)
        row = run_one(f"{preset}-w{world}", preset, world, cfg, out, passthrough, sources)
        skipped += [{"name": row["name"], "parallel": preset, "world_size": world, "source": src,
                     "reason": row["sources"][src]["skipped"]}
                    for src in sources if "skipped" in row["sources"].get(src, {})]
        if "error" in row:
            into.append(row)
    figures = suite_figures(rows)
    result = {"against": against, "figures": figures,
              "sources": {src: suite_figures(rows, src) for src in sources},
              "runs": rows, "information": info_rows, "skipped": skipped, "out_dir": str(out)}
    write_json_atomic(out / "validate.json", result)
    print(json.dumps(result, indent=2) if fmt == "json" else format_result(result))
    return result
