"""Specs: the validated description of a model, a cluster and a parallel plan."""

from twin.spec.cluster import ClusterSpec, GPUSpec, InterNodeSpec, IntraNodeSpec
from twin.spec.errors import ConfigError
from twin.spec.grid import RankGrid
from twin.spec.job import Job, build_job
from twin.spec.model import ModelSpec
from twin.spec.parallel import ConfigWarning, ParallelPlan

__all__ = ["ClusterSpec", "ConfigError", "ConfigWarning", "GPUSpec", "InterNodeSpec",
           "IntraNodeSpec", "Job", "ModelSpec", "ParallelPlan", "RankGrid", "build_job"]
