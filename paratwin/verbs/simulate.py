"""`paratwin simulate`: run the twin, write summary.json, spans.json and the report."""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import OmegaConf

from paratwin.config import job_from_cfg, load_profile
from paratwin.progress import Progress
from twin.chrome import chrome_trace
from twin.files import write_json_atomic, write_text_atomic
from twin.sim.engine import SimOptions
from twin.sim.run import simulate
from twin.sim.whatif import parse_link
from twin.spec import ConfigError

FOLDS = ("none", "dp", "tp", "all", "auto")
AUTO_FOLD_ABOVE = 512


def options_from_cfg(cfg, job) -> SimOptions:
    fold = str(cfg.get("fold", "auto"))
    if fold not in FOLDS:
        raise ConfigError(f"fold={fold!r} is not one of {'|'.join(FOLDS)}")
    if fold == "auto":
        fold = "all" if job.grid.world_size > AUTO_FOLD_ABOVE and not job.parallel.legacy_dp \
            else "none"
    algorithm = str(cfg.get("algorithm", "auto"))
    if algorithm not in ("auto", "ring", "tree", "hierarchical"):
        raise ConfigError(f"algorithm={algorithm!r} is not one of auto|ring|tree|hierarchical")
    w = cfg.get("whatif") or {}
    straggler = {}
    if w.get("straggler_rank") is not None:
        straggler[int(w["straggler_rank"])] = float(w.get("straggler_factor", 1.0))
    degraded = {}
    if w.get("degraded_link"):
        degraded[parse_link(str(w["degraded_link"]))] = float(w.get("degraded_factor", 1.0))
    return SimOptions(fold=fold, algorithm=algorithm, straggler=straggler, degraded=degraded,
                      jitter=bool(cfg.get("jitter", False)), seed=int(cfg.get("seed", 0)))


def out_dir_of(cfg) -> Path:
    if cfg.get("out_dir"):
        return Path(str(cfg.out_dir))
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


def _size(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.2f} MB"


def format_summary(job, s: dict, out: Path) -> str:
    p = job.parallel
    lines = [
        f"simulated {job.model.name} on {job.cluster.name}: {job.grid.world_size} GPUs, dp={p.dp} "
        f"tp={p.tp}{' +sp' if p.sp else ''} pp={p.pp} zero={p.zero_stage}"
        + (f" {p.pp_schedule}" if p.pp > 1 else "") + f", {p.num_microbatches} micro-batch(es)",
        f"  {s['steps']} step(s); {s['simulated_ranks']} of {s['world_size']} ranks simulated "
        + ("(no folding)" if s["fold"] == "none" else f"(FOLDED along {s['fold']}: copies simulated once)")
        + f"; {s['events']:,} events in {s['wall_s']:.2f} s; profile {s['profile']}",
        f"  step time {s['step_time_s'] * 1e3:,.2f} ms"
        + (f" (p10 {s['step_time_p10_s'] * 1e3:,.2f}, p90 {s['step_time_p90_s'] * 1e3:,.2f} ms)"
           if s["steps"] > 1 else "")
        + f"   {s['tokens_per_s']:,.0f} tokens/s   {s['tflops_per_gpu']:.1f} TFLOP/s per GPU"
        f"   MFU {s['mfu']:.1%}",
        f"  pipeline bubble {s['bubble_fraction']:.1%}   exposed communication: "
        + (", ".join(f"{g} {v * 1e3:.2f} ms" for g, v in s["exposed_comm_s"].items()) or "none"),
    ]
    peak, hbm = s["peak_memory_max_bytes"], job.cluster.hbm_bytes
    worst = max(s["peak_memory_bytes"], key=lambda r: s["peak_memory_bytes"][r])
    if s["fits_memory"]:
        lines.append(f"  peak memory {_size(peak)} of {hbm / 1e9:.0f} GB (rank {worst}): fits")
    else:
        lines.append(f"  !! DOES NOT FIT: peak memory {_size(peak)} > {hbm / 1e9:.0f} GB of HBM "
                     f"on rank {worst} (out of memory by {(peak - hbm) / 1e9:.2f} GB); the times "
                     "above assume it fit")
    lines.append(f"  wrote {out}/summary.json, spans.json, trace.json"
                 + (", report.html" if (out / "report.html").exists() else ""))
    return "\n".join(lines)


def run(cfg) -> dict:
    fmt = cfg.get("format", "text")
    if fmt not in ("text", "json"):
        raise ConfigError(f"format={fmt!r} is not one of text|json")
    steps = int(cfg.get("steps", 1))
    if steps < 1:
        raise ConfigError(f"steps={steps} must be at least 1")
    job = job_from_cfg(cfg)
    cost = load_profile(cfg.get("calibration"), job.cluster)
    options = options_from_cfg(cfg, job)
    out = out_dir_of(cfg)
    out.mkdir(parents=True, exist_ok=True)
    bar = Progress("paratwin simulate")
    result = simulate(job, cost, options, steps=steps, progress=bar.update)
    bar.close()
    (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    result.trace.save(out / "spans.json")
    summary = dict(result.summary, out_dir=str(out))
    write_json_atomic(out / "summary.json", summary)
    if cfg.get("report", True):
        from twin.report import write_report

        write_report([out])  # report.html and the Chrome export trace.json (memory counters)
    else:
        write_text_atomic(out / "trace.json", json.dumps(chrome_trace(result.trace)))
    print(json.dumps(summary, indent=2) if fmt == "json" else format_summary(job, summary, out))
    return summary
