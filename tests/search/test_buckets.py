"""The estimate's bucketed calls (twin.search.buckets) against the calls the schedule makes:
a tensor over the cap is a bucket of its own, so bytes / cap is not the count."""

from __future__ import annotations

import dataclasses

import pytest

from tests.conftest import gpt
from tests.search.test_estimate import H100x2
from twin.cost import default_cost_model
from twin.schedule.step import build_program
from twin.search.buckets import calls
from twin.search.estimate import Estimator
from twin.spec import ParallelPlan, build_job
from twin.spec.moe import MoESpec

WIDE = gpt(num_layers=4, hidden_size=2048, num_heads=16, num_kv_heads=16, ffn_hidden_size=8192,
           seq_len=512, vocab_size=8000)
"""Its MLP matrices (2048 x 8192, 32 MiB in bf16) are over the 25 MiB bucket cap."""
WIDE_MOE = dataclasses.replace(WIDE, name="wide_moe", moe=MoESpec(
    num_experts=4, experts_per_token=2, moe_ffn_hidden_size=4096))


def _reductions(job, group: str) -> int:
    prog = build_program(job, 0)
    return sum(op.kind == "reduce_scatter" and op.group_name == group and op.phase == "bwd"
               for op in prog.ops)


@pytest.mark.parametrize("tp", [1, 2])
def test_dense_calls_are_the_schedules_buckets(tp):
    job = build_job(WIDE, H100x2, ParallelPlan(tp=tp, zero_stage=1, global_batch_size=16))
    shape = Estimator(default_cost_model(H100x2)).shape(job)
    nbytes = shape.params[0] * WIDE.dtype_bytes
    got = calls(job, shape.layers[0], nbytes)
    assert got == _reductions(job, "dp")
    assert got < nbytes / (job.parallel.ddp_bucket_MB * 1024 * 1024)  # what bytes / cap gave


def test_expert_calls_are_the_schedules_buckets():
    job = build_job(WIDE_MOE, H100x2, ParallelPlan(tp=2, sp=True, etp=1, zero_stage=1,
                                                   global_batch_size=16))
    shape = Estimator(default_cost_model(H100x2)).shape(job)
    assert shape.experts and shape.experts[0] > 0
    got = calls(job, shape.layers[0], shape.experts[0] * WIDE.dtype_bytes, experts=True)
    assert got == _reductions(job, "edp")
