"""`paratwin conformance`: the schedule's collectives vs what PyTorch's own DDP/FSDP2/TP/PP issue.

Composes the job, checks that PyTorch has a counterpart for the plan, spawns the ranks
(executor.conformance.rank), prints both inventories side by side with the differences
and the loss agreement, and the steps' wall time after the first (``format=json``: the same
as JSON, the times under ``timing``; `paratwin validate against=pytorch` uses them). Exits 1
when a difference is unexplained or the losses disagree, 2 on a config error.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from paratwin.config import job_from_cfg
from twin.spec import ConfigError
from twin.spec.errors import check_choice, check_positive


def settings(cfg) -> dict:
    """The verb's own settings; every problem at once."""
    problems: list[str] = []
    steps = cfg.get("steps", 3)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        problems.append(f"steps={steps!r} must be a whole number >= 2 (the last step is compared, "
                        "the ones before warm PyTorch up)")
    check_choice(problems, "format", cfg.get("format", "text"), ("text", "json"))
    check_positive(problems, "timeout_s", cfg.get("timeout_s", 120))
    check_positive(problems, "rtol", cfg.get("rtol", 1e-5))
    seed, threads = cfg.get("seed", 0), cfg.get("threads", 1)
    if not isinstance(seed, int) or seed < 0:
        problems.append(f"seed={seed!r} must be a whole number >= 0")
    if not isinstance(threads, int) or threads < 1:
        problems.append(f"threads={threads!r} must be a whole number >= 1")
    if not cfg.get("out_dir"):
        problems.append("out_dir is empty; give a run directory (default "
                        "reports/conformance/<timestamp>)")
    if problems:
        raise ConfigError(problems)
    return {"steps": steps, "seed": seed, "threads": threads, "format": cfg.get("format", "text"),
            "timeout_s": float(cfg.get("timeout_s", 120)), "rtol": float(cfg.get("rtol", 1e-5)),
            "out_dir": Path(str(cfg.out_dir))}


def run(cfg) -> dict:
    from executor.conformance.model import check_model
    from executor.conformance.parallelize import check_plan
    from executor.conformance.runner import conform, format_text
    from executor.launch import LaunchError

    s = settings(cfg)
    job = job_from_cfg(cfg)
    check_model(job.model)
    check_plan(job)
    if job.grid.world_size > 8:
        raise ConfigError(f"conformance spawns one gloo rank per device: {job.grid.world_size} "
                          "ranks is more than this check runs (at most 8); lower "
                          "cluster.gpus_per_node or cluster.num_nodes")
    try:
        res = conform(job, s["out_dir"], steps=s["steps"], seed=s["seed"], timeout_s=s["timeout_s"],
                      threads=s["threads"], rtol=s["rtol"],
                      log=lambda m: print(f"paratwin conformance: {m}", file=sys.stderr))
    except LaunchError as err:
        print(f"paratwin conformance: {err}", file=sys.stderr)
        sys.exit(1)
    print(json.dumps(res, indent=2) if s["format"] == "json" else format_text(res))
    if res["differences"] or not res["losses"]["match"]:
        sys.exit(1)
    return res
