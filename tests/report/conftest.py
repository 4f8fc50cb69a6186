"""Run directories made by the real twin (small jobs, seconds), shared by the report tests."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from tests.conftest import cluster, gpt
from twin.cost import default_cost_model
from twin.sim.engine import SimOptions
from twin.sim.run import simulate
from twin.spec import ParallelPlan, build_job
from twin.spec.io import job_to_dict


def write_run(directory: Path, job, steps: int = 1, options: SimOptions | None = None,
              cost=None, trace_name: str = "spans.json", summary: bool = True):
    """A run directory as `paratwin simulate` writes it: spans, summary, config."""
    directory.mkdir(parents=True, exist_ok=True)
    result = simulate(job, cost=cost, options=options, steps=steps)
    result.trace.save(directory / trace_name)
    if summary:
        (directory / "summary.json").write_text(json.dumps(result.summary.to_dict(), default=float))
    (directory / "config.yaml").write_text(yaml.safe_dump(job_to_dict(job)))
    return result


def job_3d(**plan):
    """dp2 tp2 pp2 (1F1B, SP, ZeRO-1) on 8 GPUs: every stream kind, p2p and bubbles."""
    return build_job(gpt(num_layers=4), cluster(1, 8), ParallelPlan(tp=2, pp=2, sp=True,
                                                                     zero_stage=1, **plan))


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> dict[str, Path]:
    """single: a 3D run; jitter: the same schedule with noise; sweep/N: FSDP on N nodes;
    oom: a job that does not fit; pp: a small pipeline (bars, not WebGL)."""
    root = tmp_path_factory.mktemp("runs")
    out = {"single": root / "single", "jitter": root / "jitter", "sweep": root / "sweep",
           "oom": root / "oom", "pp": root / "pp"}
    write_run(out["single"], job_3d())
    cost = dataclasses.replace(default_cost_model(job_3d().cluster), compute_cv=0.1, comm_cv=0.2)
    write_run(out["jitter"], job_3d(), options=SimOptions(jitter=True, seed=7), cost=cost)
    for i, nodes in enumerate((1, 2, 4)):
        write_run(out["sweep"] / f"{i}-cluster.num_nodes={nodes}",
                  build_job(gpt(num_layers=2), cluster(nodes, 4), ParallelPlan(zero_stage=3)))
    small = dataclasses.replace(cluster(1, 2), gpu=dataclasses.replace(cluster().gpu, hbm_GB=0.01))
    write_run(out["oom"], build_job(gpt(num_layers=2), small, ParallelPlan(zero_stage=0)))
    write_run(out["pp"], build_job(gpt(num_layers=4), cluster(1, 2),
                                   ParallelPlan(pp=2, global_batch_size=4)))
    return out


COLLECTIVES_CSV = ("kind,group_size,bytes,dtype,time_s_median,time_s_p10,time_s_p90,algbw_GBps,"
                   "busbw_GBps,repeats,backend,extra\n") + """\
all_reduce,2,4096,fp32,0.0004,0.0003,0.0005,0.01,0.01,3,gloo,x
all_reduce,2,262144,fp32,0.0009,0.0008,0.001,0.3,0.3,3,gloo,x
all_reduce,2,4194304,fp32,0.006,0.005,0.007,0.7,0.7,3,gloo,x
all_gather,2,4096,fp32,0.0004,0.0003,0.0005,0.01,0.01,3,gloo,x
all_gather,2,4194304,fp32,0.003,0.002,0.004,1.4,0.7,3,gloo,x
sendrecv,2,4096,fp32,0.0002,0.0001,0.0003,0.02,0.02,3,gloo,x
sendrecv,2,4194304,fp32,0.004,0.003,0.005,1.0,1.0,3,gloo,x
"""
KERNELS_CSV = """kind,dtype,shape,flops,bytes,time_s_median,time_s_p10,time_s_p90,repeats,tflops,GBps,device
gemm,fp32,256x256x256,3.35544e+07,786432,0.000338412,0.000335458,0.00057965,3,0.099,2.3,cpu
gemm,fp32,1024x1024x1024,2.14748e+09,1.25829e+07,0.031,0.030,0.033,3,0.069,0.4,cpu
attention.bwd,fp32,1x8x8x512x64x1,1.07e+09,4.2e+06,0.02,0.019,0.022,3,0.05,0.2,cpu
elementwise,fp32,65536,65536,786432,1.3e-05,1.2e-05,2e-05,3,0.005,60,cpu
"""


@pytest.fixture(scope="session")
def bench_dir(tmp_path_factory) -> Path:
    """A `paratwin bench` directory: both CSVs and meta.json of a gloo run, no cluster config."""
    d = tmp_path_factory.mktemp("bench")
    (d / "collectives.csv").write_text(COLLECTIVES_CSV)
    (d / "kernels.csv").write_text(KERNELS_CSV)
    (d / "meta.json").write_text(json.dumps({"backend": "gloo", "world_size": 2}))
    (d / "notes.csv").write_text("a,b\n1,2\n")  # not a benchmark table: ignored
    return d
