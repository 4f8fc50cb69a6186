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


def _fields(node) -> dict:
    """A config node as keyword arguments: Hydra's ``defaults`` list left out."""
    return {k: v for k, v in dict(node or {}).items() if k != "defaults"}


def cluster_from_dict(c: dict) -> ClusterSpec:
    """A ClusterSpec from a dict (``job_to_dict``'s, a resolved config's or a preset file's);
    absent fields and blocks take their defaults."""
    c = _fields(c)
    return ClusterSpec(**{**c, "gpu": GPUSpec(**_fields(c.get("gpu"))),
                          "intra": IntraNodeSpec(**_fields(c.get("intra"))),
                          "inter": InterNodeSpec(**_fields(c.get("inter")))})


def job_from_dict(d: dict) -> Job:
    """Inverse of ``job_to_dict`` (validates again); also reads a resolved config's
    model, cluster and parallel nodes."""
    return build_job(ModelSpec(**_fields(d["model"])), cluster_from_dict(d["cluster"]),
                     ParallelPlan(**_fields(d["parallel"])))
