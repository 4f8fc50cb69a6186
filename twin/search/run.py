"""evaluate(): every plan of a space enumerated, pruned by memory and ranked by the estimate.

Per GPU count, tp and pp (one task each, spread over worker processes when asked): each
memory plan (a plan in the default rank order; memory does not depend on the order) is cut
by a lower bound of its memory, then held against the HBM with the inspect model
(``twin.search.memory``); each rank order of a plan that fits is estimated
(``twin.search.estimate``). ``Evaluation.candidates`` are the plans that fit, fastest
first; ``smallest`` the plan with the least memory found, for saying why nothing fits.
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from twin.cost import CostModel
from twin.search.estimate import Estimate, Estimator
from twin.search.memory import SearchJob, lower_bound, peak_memory
from twin.search.space import (
    SearchSpace,
    check_space,
    cluster_for,
    divisors,
    legal_tp,
    memory_plans,
    orders_for,
    plan_sizes,
)
from twin.spec import ClusterSpec, ConfigWarning, ModelSpec, ParallelPlan


@dataclass(frozen=True)
class Candidate:
    """A plan that fits, with its memory and estimate."""

    plan: ParallelPlan
    gpus: int
    peak_memory_bytes: float
    estimate: Estimate

    @property
    def step_time_s(self) -> float:
        return self.estimate.step_time_s


@dataclass
class Evaluation:
    """What ``evaluate`` found."""

    evaluated: int
    """Plans considered (every rank order of every legal plan)."""
    fit: int
    """Plans that fit in memory."""
    candidates: list[Candidate]
    """The plans that fit, by estimated step time (fastest first)."""
    smallest: tuple[float, ParallelPlan, int] | None
    """(peak bytes, plan, GPUs) of the plan with the least memory found."""
    seconds: float = 0.0


Task = tuple[int, int, int]
"""(GPUs, tp, pp): one unit of work."""

_ESTIMATOR: Estimator | None = None


def _init(cost: CostModel) -> None:
    global _ESTIMATOR
    _ESTIMATOR = Estimator(cost)


def _task(args: tuple) -> tuple:
    model, cluster, space, task = args
    assert _ESTIMATOR is not None
    return run_task(model, cluster, space, task, _ESTIMATOR)


def run_task(model: ModelSpec, cluster: ClusterSpec, space: SearchSpace, task: Task,
             est: Estimator) -> tuple[int, int, list[Candidate], tuple | None]:
    """(evaluated, fit, candidates, smallest) of the plans of one (GPUs, tp, pp)."""
    gpus, tp, pp = task
    cl = cluster_for(cluster, gpus)
    hbm = cl.hbm_bytes
    part = dataclasses.replace(space, tp=(tp,), pp=(pp,))
    evaluated = fit = 0
    out: list[Candidate] = []
    smallest: tuple | None = None
    cut: list[tuple[float, ParallelPlan]] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)  # legal plans that only warn
        for plan in memory_plans(model, gpus, part):
            orders = orders_for(plan_sizes(plan), space.rank_order)
            evaluated += len(orders)
            job = SearchJob(model=model, cluster=cl, parallel=plan)
            bound = lower_bound(job)
            if bound > hbm:
                cut.append((bound, plan))
                continue
            peak = peak_memory(job).total_bytes
            if smallest is None or peak < smallest[0]:
                smallest = (peak, plan, gpus)
            if peak > hbm:
                continue
            fit += len(orders)
            for order in orders:
                p = plan if order == plan.rank_order else \
                    dataclasses.replace(plan, rank_order=order)
                j = job if p is plan else SearchJob(model=model, cluster=cl, parallel=p)
                out.append(Candidate(p, gpus, peak, est(j)))
    if not fit:  # the least memory may hide behind the cut: measure what could be smaller
        for bound, plan in sorted(cut, key=lambda x: x[0]):
            if smallest is not None and bound >= smallest[0]:
                break
            peak = peak_memory(SearchJob(model=model, cluster=cl, parallel=plan)).total_bytes
            if smallest is None or peak < smallest[0]:
                smallest = (peak, plan, gpus)
    return evaluated, fit, out, smallest


def tasks(model: ModelSpec, space: SearchSpace) -> list[Task]:
    """Every (GPUs, tp, pp) the space holds, largest expected first."""
    out = [(g, t, p) for g in space.gpus for t in legal_tp(model, g)
           if space.tp is None or t in space.tp
           for p in divisors(model.num_layers)
           if g % (t * p) == 0 and (space.pp is None or p in space.pp)]
    return sorted(out, key=lambda x: (-x[2], -x[1], x[0]))


def evaluate(model: ModelSpec, cluster: ClusterSpec, space: SearchSpace, cost: CostModel,
             workers: int = 1, progress: Callable[[int, int, str], None] | None = None) \
        -> Evaluation:
    """Enumerate, prune and estimate every plan of ``space`` (see the module docstring).

    ConfigError (one line) when the space cannot hold a plan (``check_space``).
    ``workers`` > 1 spreads the tasks over that many processes."""
    t0 = time.perf_counter()
    check_space(model, cluster, space)
    todo = tasks(model, space)
    workers = max(1, min(workers or os.cpu_count() or 1, len(todo) or 1))
    results = []
    if workers == 1:
        est = Estimator(cost)
        for k, task in enumerate(todo):
            results.append(run_task(model, cluster, space, task, est))
            if progress:
                progress(k + 1, len(todo), "evaluating plans")
    else:
        with ProcessPoolExecutor(workers, initializer=_init, initargs=(cost,)) as pool:
            args = [(model, cluster, space, task) for task in todo]
            for k, res in enumerate(pool.map(_task, args, chunksize=1)):
                results.append(res)
                if progress:
                    progress(k + 1, len(todo), "evaluating plans")
    candidates = sorted((c for r in results for c in r[2]),
                        key=lambda c: (c.step_time_s, c.gpus, c.peak_memory_bytes))
    small = [r[3] for r in results if r[3] is not None]
    return Evaluation(evaluated=sum(r[0] for r in results), fit=sum(r[1] for r in results),
                      candidates=candidates,
                      smallest=min(small, key=lambda s: s[0]) if small else None,
                      seconds=time.perf_counter() - t0)
