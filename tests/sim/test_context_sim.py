"""Context parallelism in the twin: folding stays exact (CP ranks are never folded together),
and an unbalanced causal split costs the step its slowest rank."""

from __future__ import annotations

import pytest

from tests.conftest import cluster, gpt
from twin.sim.engine import SimOptions
from twin.sim.run import simulate
from twin.spec import ParallelPlan, build_job


@pytest.mark.parametrize("method,balance", [("ring", "none"), ("ring", "headtail"),
                                            ("allgather", "none"), ("alltoall", "headtail")])
def test_fold_auto_equals_the_full_run(method, balance):
    """dp and tp copies fold; the CP ranks, whose programs may differ, are all simulated."""
    job = build_job(gpt(), cluster(gpus=8), ParallelPlan(cp=2, tp=2, cp_method=method,
                                                         cp_load_balance=balance,
                                                         global_batch_size=4))
    full = simulate(job, options=SimOptions(fold="none"), trace="none").summary
    auto = simulate(job, options=SimOptions(fold="auto"), trace="none").summary
    assert auto["simulated_ranks"] == 2 < full["simulated_ranks"] == 8
    assert auto["step_time_s"] == pytest.approx(full["step_time_s"], rel=1e-12)
    assert "cp" in full["exposed_comm_s"] and "dp-cp" in full["exposed_comm_s"]


def test_unbalanced_causal_split_is_slower_and_its_last_rank_busiest():
    """s = 8192 over cp = 4 with contiguous chunks: the last rank's attention is 7/4 of the
    average, so its compute and the step exceed the head-tail split's."""
    m = gpt(seq_len=8192, num_layers=2, hidden_size=512, ffn_hidden_size=1024)
    runs = {}
    for balance in ("headtail", "none"):
        job = build_job(m, cluster(gpus=4), ParallelPlan(cp=4, cp_load_balance=balance,
                                                         global_batch_size=1))
        runs[balance] = simulate(job, trace="none").summary
    compute = [runs["none"]["compute_s"][str(r)] for r in range(4)]
    assert compute == sorted(compute) and compute[3] > 2 * compute[0]
    assert runs["none"]["step_time_s"] > 1.2 * runs["headtail"]["step_time_s"]
    even = list(runs["headtail"]["compute_s"].values())
    assert max(even) == pytest.approx(min(even), rel=0.01)
