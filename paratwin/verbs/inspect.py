"""`paratwin inspect`: the memory calculator (no simulation, no torch)."""

from __future__ import annotations

import json

from paratwin.config import job_from_cfg
from twin.spec import ConfigError
from twin.workload.summary import format_inspect, inspect_job, memory_fixes


def run(cfg) -> dict:
    """Print the inspect report of the composed config as text or JSON."""
    fmt = cfg.get("format", "text")
    if fmt not in ("text", "json"):
        raise ConfigError(f"format={fmt!r} is not one of text|json")
    job = job_from_cfg(cfg)
    report = inspect_job(job)
    if not report["fits_memory"]:  # what single change of the plan would make it fit
        report["fixes"] = memory_fixes(job)
    print(json.dumps(report, indent=2) if fmt == "json" else format_inspect(report))
    return report
