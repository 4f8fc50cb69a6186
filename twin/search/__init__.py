"""Plan search: every legal plan of a model on a cluster, pruned by memory, ranked by a fast
estimate, the best checked against the full twin.

``space`` enumerates (``SearchSpace``, ``plans``), ``memory`` prunes (the inspect model),
``units``, ``comm`` and ``estimate`` give the closed-form step time, ``run.evaluate`` does
all of it over a space (in worker processes when asked), ``check`` simulates chosen plans
and measures the agreement, ``pareto`` finds the front. No Hydra, no CLI here.
"""

from twin.search.check import agreement, simulate_candidate
from twin.search.estimate import Estimate, Estimator
from twin.search.pareto import pareto_front
from twin.search.run import Candidate, Evaluation, evaluate
from twin.search.space import SearchSpace, canonical, gpu_counts, plans

__all__ = ["Candidate", "Estimate", "Estimator", "Evaluation", "SearchSpace", "agreement",
           "canonical", "evaluate", "gpu_counts", "pareto_front", "plans", "simulate_candidate"]
