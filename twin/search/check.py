"""The estimate held against the twin: simulate chosen plans, and how well the two agree.

``simulate_candidate`` runs one plan through the full twin (``twin.sim.run.simulate``,
``fold=auto``: every copy folded that is exact, and seconds instead of minutes at a thousand
GPUs); ``agreement``
says how the estimate ranks and sizes the same plans: Spearman's rank correlation, the
largest and median relative error, and the regret of the estimate's choice (its pick's
simulated time over the best simulated, minus one).
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Sequence

from scipy.stats import spearmanr

from twin.cost import CostModel
from twin.search.run import Candidate
from twin.search.space import cluster_for
from twin.sim.engine import SimOptions
from twin.sim.run import SimResult, simulate
from twin.spec import ClusterSpec, ConfigWarning, Job, ModelSpec, build_job


def candidate_job(model: ModelSpec, cluster: ClusterSpec, cand: Candidate) -> Job:
    """The job of a candidate, checked by build_job (quietly: a legal 1F1B fill/drain
    warns, and the search lists it with its bubble)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        return build_job(model, cluster_for(cluster, cand.gpus), cand.plan)


def simulate_candidate(model: ModelSpec, cluster: ClusterSpec, cand: Candidate,
                       cost: CostModel, fold: str = "auto", progress=None) -> SimResult:
    """One step of the candidate's plan in the full twin."""
    job = candidate_job(model, cluster, cand)
    return simulate(job, cost, SimOptions(fold=fold), progress=progress)


def agreement(estimated_s: Sequence[float], simulated_s: Sequence[float]) -> dict:
    """Rank correlation, errors and the estimate's regret over the same plans."""
    n = len(estimated_s)
    if n != len(simulated_s) or n == 0:
        raise ValueError("agreement needs as many estimates as simulated times (at least one)")
    errors = sorted(abs(e / s - 1) for e, s in zip(estimated_s, simulated_s))
    rho = spearmanr(estimated_s, simulated_s).statistic if n >= 3 else float("nan")
    pick = min(range(n), key=lambda i: estimated_s[i])
    return {"plans": n, "spearman": None if math.isnan(rho) else float(rho),
            "max_abs_error": errors[-1], "median_abs_error": statistics.median(errors),
            "regret": simulated_s[pick] / min(simulated_s) - 1}
