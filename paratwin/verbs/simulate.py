"""`paratwin simulate`: run the twin, write summary.json, spans.json and the report."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from omegaconf import OmegaConf

from paratwin.config import job_from_cfg, load_profile
from paratwin.outdir import out_dir
from paratwin.progress import Progress
from twin import rundir
from twin.chrome import write_chrome
from twin.files import write_json_atomic
from twin.sim.engine import SimOptions
from twin.sim.run import check_budget, resolve_options, simulate
from twin.sim.spans import TRACE_LEVELS
from twin.sim.whatif import check_options, parse_link
from twin.spec import ConfigError, ConfigWarning
from twin.spec.errors import raise_if

FOLDS = ("none", "dp", "tp", "all", "auto")


def _whole(value, field: str, meaning: str, problems: list[str],
           low: int | None = 0) -> int | None:
    """An integer field (``3``, ``"3"``) of at least ``low``, else a problem naming it;
    None when missing."""
    if value is None:
        return None
    if not isinstance(value, bool):
        try:
            if isinstance(value, str) or float(value) == int(value):
                number = int(value)
                if low is None or number >= low:
                    return number
        except (TypeError, ValueError, OverflowError):
            pass
    at_least = "" if low is None else f" >= {low}"
    problems.append(f"{field}={value!r} must be a whole number{at_least} ({meaning})")
    return None


def _real(value, field: str, meaning: str, problems: list[str]) -> float | None:
    """A number field (``0.5``, ``"0.5"``), else a problem naming it; range: check_options."""
    if not isinstance(value, bool):
        try:
            return float(value)
        except (TypeError, ValueError):
            pass
    problems.append(f"{field}={value!r} must be a finite number > 0 ({meaning})")
    return None


def options_from_cfg(cfg, job) -> SimOptions:
    """SimOptions from the config; every value that cannot be read is one ConfigError
    (ranges are checked against the job by twin.sim.whatif.check_options)."""
    problems: list[str] = []
    fold = str(cfg.get("fold", "auto"))
    if fold not in FOLDS:
        problems.append(f"fold={fold!r} is not one of {'|'.join(FOLDS)}")
    fast = cfg.get("fast_forward", True)
    if not isinstance(fast, bool):
        problems.append(f"fast_forward={fast!r} must be true or false (advance a pipeline's "
                        "steady state by whole periods)")
    algorithm = str(cfg.get("algorithm", "auto"))
    if algorithm not in ("auto", "ring", "tree", "hierarchical"):
        problems.append(f"algorithm={algorithm!r} is not one of auto|ring|tree|hierarchical")
    w = cfg.get("whatif") or {}
    if not hasattr(w, "get"):
        raise ConfigError(f"whatif={w!r} must be a group of fields, e.g. whatif.straggler_rank=3 "
                          "whatif.straggler_factor=2.0 or whatif.degraded_link=nic_out:0:0 "
                          "whatif.degraded_factor=0.5")
    straggler, degraded = {}, {}
    rank = _whole(w.get("straggler_rank"), "whatif.straggler_rank",
                  "the rank that computes slower", problems, low=None)
    factor = _real(w.get("straggler_factor", 1.0), "whatif.straggler_factor",
                   "2.0: the straggler computes at half speed", problems)
    if rank is not None and factor is not None:
        straggler[rank] = factor
    elif w.get("straggler_rank") is None and factor not in (None, 1.0):
        warnings.warn(f"whatif.straggler_factor={factor:g} has no effect without "
                      "whatif.straggler_rank; set whatif.straggler_rank=R (the rank to slow)",
                      ConfigWarning, stacklevel=2)
    factor = _real(w.get("degraded_factor", 1.0), "whatif.degraded_factor",
                   "0.5: the link keeps half its bandwidth", problems)
    if w.get("degraded_link"):
        link = parse_link(str(w["degraded_link"]))
        if factor is not None:
            degraded[link] = factor
    elif factor not in (None, 1.0):
        warnings.warn(f"whatif.degraded_factor={factor:g} has no effect without "
                      "whatif.degraded_link; set whatif.degraded_link=KIND:INDEX..., e.g. "
                      "nic_out:0:0 (node 0, NIC 0)", ConfigWarning, stacklevel=2)
    seed = _whole(cfg.get("seed", 0), "seed", "jitter's random seed", problems)
    raise_if(problems)
    return SimOptions(fold=fold, algorithm=algorithm, straggler=straggler, degraded=degraded,
                      jitter=bool(cfg.get("jitter", False)), seed=seed or 0,
                      fast_forward=fast is True)


def trace_level(cfg) -> str:
    level = str(cfg.get("trace", "auto"))
    if level not in TRACE_LEVELS:
        raise ConfigError(f"trace={level!r} is not one of {'|'.join(TRACE_LEVELS)} (auto: what "
                          "the report draws; full: every simulated rank's spans; none: the "
                          "summary only)")
    return level


def out_dir_of(cfg) -> Path:
    """out_dir, a -m sweep point's directory, or reports/simulate/<time>-<model>-<parallel>."""
    if cfg.get("out_dir"):
        return Path(str(cfg.out_dir))
    from hydra.core.hydra_config import HydraConfig

    choices = HydraConfig.get().runtime.choices
    return out_dir(cfg, "simulate", f"{choices.get('model')}-{choices.get('parallel')}")


def _size(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.2f} MB"


def format_summary(job, s: dict, out: Path, chrome: str = "trace.json") -> str:
    p = job.parallel
    lines = [
        f"simulated {job.model.name} on {job.cluster.name}: {job.grid.world_size} GPUs, dp={p.dp} "
        + (f"(HSDP {p.dp_replicate} replicas x {p.shard_degree} shards) " if p.dp_replicate > 1 else "")
        + f"tp={p.tp}{' +sp' if p.sp else ''} pp={p.pp} zero={p.zero_stage}"
        + (f" cp={p.cp} ({p.cp_method}, {p.cp_load_balance})" if p.cp > 1 else "")
        + (f" {p.pp_schedule}" if p.pp > 1 else "") + f", {p.num_microbatches} micro-batch(es)",
        f"  {s['steps']} step(s); {s['simulated_ranks']} of {s['world_size']} ranks simulated "
        + ("(no folding)" if s["fold"] == "none" else f"(FOLDED along {s['fold']}: copies simulated once)")
        + f"; {s['events']:,} events in {s['wall_s']:.2f} s; profile {s['profile']}",
        f"  step time {s['step_time_s'] * 1e3:,.2f} ms"
        + (f" (p10 {s['step_time_p10_s'] * 1e3:,.2f}, p90 {s['step_time_p90_s'] * 1e3:,.2f} ms)"
           if s["steps"] > 1 else "")
        + f"   {s['tokens_per_s']:,.0f} tokens/s   {s['tflops_per_gpu']:.3g} TFLOP/s per GPU"
        f"   MFU {s['mfu']:.1%}" + (f" (of the {job.peak_dtype} peak)" if job.parallel.float8 != "none"
                                   else ""),
        f"  pipeline bubble {s['bubble_fraction']:.1%}   exposed communication: "
        + (", ".join(f"{g} {v * 1e3:.2f} ms" for g, v in s["exposed_comm_s"].items()) or "none"),
    ]
    ff = s.get("fast_forward")
    if ff:
        lines.insert(2, f"  fast-forwarded: {ff['simulated_microbatches']} of "
                        f"{ff['microbatches']} micro-batches simulated, {ff['periods']} steady "
                        f"period(s) of {ff['period_microbatches']} micro-batch(es) "
                        f"({ff['period_s'] * 1e3:,.2f} ms each) added exactly")
    for note in s.get("notes") or ():
        lines.insert(2, f"  note: {note}")
    parts = s.get("critical_path_s") or {}
    if parts:
        total = sum(parts.values()) or 1.0
        lines.append("  critical path: " + ", ".join(
            f"{k} {v / total:.0%}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])
            if v / total >= 0.005))
        shaped = s.get("critical_path_shape_factors_s") or 0.0
        if abs(shaped) / total >= 0.005:
            lines[-1] += (f" (kernel shape factors {'+' if shaped > 0 else '-'}"
                          f"{abs(shaped) / total:.0%} of it)")
    peak, hbm = s["peak_memory_max_bytes"], job.cluster.hbm_bytes
    worst = max(s["peak_memory_bytes"], key=lambda r: s["peak_memory_bytes"][r])
    if s["fits_memory"]:
        lines.append(f"  peak memory {_size(peak)} of {hbm / 1e9:.0f} GB (rank {worst}): fits")
    else:
        lines.append(f"  !! DOES NOT FIT: peak memory {_size(peak)} > {hbm / 1e9:.0f} GB of HBM "
                     f"on rank {worst} (out of memory by {(peak - hbm) / 1e9:.2f} GB); the times "
                     "above assume it fit")
    level = (s.get("trace") or {}).get("level", "full")
    traced = "" if level == "none" else f", spans.json ({_traced(s)}), {chrome}"
    lines.append(f"  wrote {out}/summary.json{traced}"
                 + (", report.html" if (out / "report.html").exists() else ""))
    return "\n".join(lines)


def _traced(s: dict) -> str:
    """What spans.json holds, in words."""
    t = s.get("trace") or {}
    ranks = t.get("recorded_ranks") or []
    if t.get("level") == "full" or len(ranks) == s["simulated_ranks"]:
        return f"every simulated rank's spans: {len(ranks)}"
    return (f"{len(ranks)} of {s['simulated_ranks']} simulated ranks, what the report draws; "
            "trace=full for all")


def run(cfg) -> dict:
    fmt = cfg.get("format", "text")
    if fmt not in ("text", "json"):
        raise ConfigError(f"format={fmt!r} is not one of text|json")
    problems: list[str] = []
    steps = _whole(cfg.get("steps", 1), "steps", "simulated steps", problems, low=1)
    raise_if(problems)
    level = trace_level(cfg)
    job = job_from_cfg(cfg)
    cost = load_profile(cfg.get("calibration"), job.cluster)
    options = options_from_cfg(cfg, job)
    resolved, _ = resolve_options(job, options, steps)
    check_budget(job, resolved.fold, steps)  # before the run directory: nothing written
    check_options(job, resolved, cost)
    out = rundir.claim(out_dir_of(cfg), "simulate", bool(cfg.get("force", False)))
    bar = Progress("paratwin simulate")
    try:  # the line ends before anything else is printed, an error included
        result = simulate(job, cost, options, steps=steps, progress=bar.update, trace=level)
        (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        trace, result.trace = result.trace, None  # held once: saved, then handed to the report
        chrome = rundir.chrome_path(out)
        if level == "none":  # an earlier run's trace would pass for this one's: remove it
            for path, kind in ((out / rundir.TRACE, "trace"), (chrome, "chrome")):
                if path.is_file() and rundir.is_kind(path, kind):
                    path.unlink()
        else:
            bar.update(0, None, f"writing {rundir.TRACE}")
            trace.save(out / rundir.TRACE)
            if not cfg.get("report", True):
                bar.update(0, None, f"writing {chrome.name}")
                write_chrome(trace, chrome)
        held = {out: trace.as_saved()} if level != "none" and cfg.get("report", True) else {}
        del trace
        summary = dict(result.summary, out_dir=str(out))
        write_json_atomic(out / "summary.json", summary)
        if cfg.get("report", True):
            from twin.report import write_report

            # report.html and the Chrome export trace.json (memory counters), from the trace in
            # memory: reading back the spans.json just written took as long as writing it
            bar.update(0, None, f"writing the report and {chrome.name}")
            write_report([out], traces=held)
        del held
    finally:
        bar.close()
    print(json.dumps(summary, indent=2) if fmt == "json"
          else format_summary(job, summary, out, chrome.name))
    return summary
