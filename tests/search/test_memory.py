"""Memory pruning: the inspect model's figure, and no plan that fits is ever dropped."""

from __future__ import annotations

import dataclasses
import statistics

import pytest

from tests.conftest import cluster
from tests.search.test_space import TINY
from twin.cost import default_cost_model
from twin.search.memory import SearchJob, lower_bound, peak_memory
from twin.search.run import evaluate
from twin.search.space import SearchSpace, memory_plans, plans
from twin.spec import build_job
from twin.workload.summary import inspect_job

MODEL = dataclasses.replace(TINY, num_layers=8, dropout=True)
"""Eight layers: pipelines of up to 8 stages, with middle stages between the first and last."""
CLUSTER = cluster(nodes=1, gpus=8)
SPACE = SearchSpace(gpus=(8,), global_batch_size=16, micro_batch_size=(1, 2))


def _inspect_peak(plan, cl=CLUSTER) -> float:
    rep = inspect_job(build_job(MODEL, cl, plan))
    return max(r["memory_bytes"]["total"] for r in rep["ranks"])


@pytest.mark.filterwarnings("ignore")
def test_peak_is_inspects_largest_rank_and_the_bound_is_below_it():
    """Three stages decide the peak (first, second, last): the same figure as inspect's
    largest listed rank, over pipelines of 1 to 8 stages and every schedule."""
    seen = set()
    for plan in memory_plans(MODEL, 8, SPACE):
        job = SearchJob(model=MODEL, cluster=CLUSTER, parallel=plan)
        peak = peak_memory(job).total_bytes
        assert peak == pytest.approx(_inspect_peak(plan), rel=1e-12)
        assert lower_bound(job) <= peak
        seen.add((plan.pp, plan.pp_schedule))
    assert {p for p, _ in seen} == {1, 2, 4, 8} and len(seen) >= 9


@pytest.mark.filterwarnings("ignore")
def test_pruning_keeps_exactly_the_plans_that_fit():
    """With the HBM set between the plans' peaks, the search keeps every plan inspect says
    fits and no other (every rank order of a plan shares its memory)."""
    peaks = {p: _inspect_peak(p) for p in memory_plans(MODEL, 8, SPACE)}
    hbm = statistics.median(peaks.values())
    cl = dataclasses.replace(CLUSTER, gpu=dataclasses.replace(CLUSTER.gpu, hbm_GB=hbm / 1e9))
    ev = evaluate(MODEL, cl, SPACE, default_cost_model(cl))
    every = list(plans(MODEL, 8, SPACE))
    fitting = {p for p in every if _inspect_peak(p, cl) <= cl.hbm_bytes}
    kept = {c.plan for c in ev.candidates}
    assert kept == fitting
    assert 0 < ev.fit == len(fitting) < ev.evaluated == len(every)
    assert ev.smallest[0] == pytest.approx(min(peaks.values()))


@pytest.mark.filterwarnings("ignore")
def test_when_nothing_fits_the_smallest_peak_is_the_least_of_all_plans():
    """The figure the one-line error quotes is the least memory of any plan, cut or not."""
    peaks = {p: _inspect_peak(p) for p in memory_plans(MODEL, 8, SPACE)}
    least = min(peaks.values())
    cl = dataclasses.replace(CLUSTER, gpu=dataclasses.replace(CLUSTER.gpu,
                                                              hbm_GB=0.999 * least / 1e9))
    ev = evaluate(MODEL, cl, SPACE, default_cost_model(cl))
    assert ev.fit == 0 and not ev.candidates
    assert ev.smallest[0] == pytest.approx(least)
    assert peaks[ev.smallest[1]] == pytest.approx(least)


@pytest.mark.filterwarnings("ignore")
def test_worker_processes_find_the_same_plans():
    cost = default_cost_model(CLUSTER)
    one = evaluate(MODEL, CLUSTER, SPACE, cost, workers=1)
    two = evaluate(MODEL, CLUSTER, SPACE, cost, workers=2)
    assert (two.evaluated, two.fit) == (one.evaluated, one.fit)
    assert [(c.plan, c.step_time_s) for c in two.candidates] == \
        [(c.plan, c.step_time_s) for c in one.candidates]
