"""The typed Summary keeps summary.json's flat keys (a public interface) and reads back."""

from __future__ import annotations

import json

import pytest

from tests.conftest import cluster
from twin.sim.run import simulate
from twin.spec import ModelSpec, ParallelPlan, build_job
from twin.summary import TWIN_FIELDS, Summary

PUBLIC_KEYS = {"step_time_s", "step_time_p10_s", "step_time_p50_s", "step_time_p90_s", "steps",
               "tokens_per_s", "tflops_per_gpu", "mfu", "bubble_fraction", "exposed_comm_s",
               "compute_s", "idle_s", "peak_memory_bytes", "peak_memory_max_bytes", "fits_memory",
               "world_size", "simulated_ranks", "events", "wall_s", "fold", "profile"}


@pytest.fixture(scope="module")
def summary() -> Summary:
    job = build_job(ModelSpec(num_layers=2, hidden_size=256, num_heads=4, ffn_hidden_size=1024,
                              vocab_size=1000, seq_len=128), cluster(1, 8), ParallelPlan(tp=2))
    return simulate(job).summary


def test_summary_json_keeps_the_readme_keys_flat(summary):
    d = summary.to_dict()
    assert PUBLIC_KEYS <= set(d)
    assert "extra" not in d and d["source"] == "twin"
    assert set(TWIN_FIELDS) <= set(d)  # what the twin says it adds, it adds
    assert json.loads(json.dumps(d)) == d  # plain JSON


def test_summary_reads_like_its_dict_and_round_trips(summary):
    d = summary.to_dict()
    assert dict(summary) == d and summary["step_time_s"] == summary.step_time_s
    assert summary["simulated_ranks"] == d["simulated_ranks"] and len(summary) == len(d)
    assert Summary.from_dict(d) == summary


def test_a_dict_without_the_metrics_is_not_a_summary():
    with pytest.raises(ValueError, match="missing .*step_time_s"):
        Summary.from_dict({"hello": 1})


def test_peak_memory_adds_what_the_alloc_ops_leave_out():
    """A rank's peak is its tensors' peak (the alloc/free spans) plus the static model's
    transients, workspaces, allocator reserve, NCCL buffers and CUDA context."""
    from tests.conftest import cluster, gpt
    from twin.metrics import OVERHEADS, peak_memory
    from twin.sim.run import simulate
    from twin.spec import ParallelPlan, build_job
    from twin.workload.memory import rank_memory

    job = build_job(gpt(), cluster(1, 2), ParallelPlan(dp=2, zero_stage=3, global_batch_size=2))
    summary = simulate(job).summary
    over = summary.extra["peak_memory_overheads_bytes"]
    static = rank_memory(job, 0)
    assert over == {k: getattr(static, k) for k in OVERHEADS} and over["cuda_context"] > 0
    tensors = peak_memory([s for s in simulate(job).trace.spans if s.rank == 0])
    assert summary.peak_memory_bytes["0"] == tensors + sum(over.values())
    assert summary.fits_memory == (summary.peak_memory_max_bytes <= job.cluster.hbm_bytes)
