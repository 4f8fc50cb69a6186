"""Jobs to and from plain dicts (for schedule files, traces and run directories)."""

from __future__ import annotations

import dataclasses

from twin.spec.cluster import ClusterSpec, GPUSpec, InterNodeSpec, IntraNodeSpec
from twin.spec.job import Job, build_job
from twin.spec.model import ModelSpec
from twin.spec.parallel import ParallelPlan


def job_to_dict(job: Job) -> dict:
    """{'model': ..., 'cluster': ..., 'parallel': ...} of plain values."""
    out = {}
    for name in ("model", "cluster", "parallel"):
        d = dataclasses.asdict(getattr(job, name))
        if name == "parallel" and d["pp_stage_layers"] is not None:
            d["pp_stage_layers"] = list(d["pp_stage_layers"])
        out[name] = d
    return out


def job_from_dict(d: dict) -> Job:
    """Inverse of ``job_to_dict`` (validates again)."""
    c = dict(d["cluster"])
    cluster = ClusterSpec(**{**c, "gpu": GPUSpec(**c["gpu"]), "intra": IntraNodeSpec(**c["intra"]),
                             "inter": InterNodeSpec(**c["inter"])})
    return build_job(ModelSpec(**d["model"]), cluster, ParallelPlan(**d["parallel"]))
