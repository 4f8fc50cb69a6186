"""How well predictions of whole runs hold up: errors, rank correlation, regret, folds.

``score(rows)`` takes rows of (model key, plan group key, measured seconds, predicted
seconds) and gives the figures a user choosing a plan cares about: the mean, median and
largest absolute relative error; Spearman's rank correlation of predicted against measured
within each model (does the twin order plans right?); and the regret of picking the plan
the twin ranks fastest within each group of interchangeable plans (same model, GPUs and
global batch): measured time of that plan over the measured best, minus one.
``kfold`` and ``holdout`` split rows for cross-validation without looking at the times.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.stats import spearmanr


@dataclass(frozen=True)
class Scored:
    """One prediction of a measured run."""

    model: Hashable
    """Rows of one model are ranked against each other (Spearman)."""
    group: Hashable
    """Rows of one group are alternative plans for the same job (regret)."""
    measured_s: float
    predicted_s: float

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured_s - 1


def score(rows: Sequence[Scored]) -> dict:
    """The figures of a set of predictions (see the module docstring)."""
    if not rows:
        raise ValueError("no predictions to score")
    err = np.array([abs(r.error) for r in rows])
    by_model: dict = defaultdict(list)
    by_group: dict = defaultdict(list)
    for r in rows:
        by_model[r.model].append(r)
        by_group[r.group].append(r)
    rho = {}
    for m, rs in by_model.items():
        if len(rs) >= 3:
            value = spearmanr([r.measured_s for r in rs], [r.predicted_s for r in rs]).statistic
            rho[m] = float(value) if not math.isnan(value) else None
    regrets = []
    for rs in by_group.values():
        if len(rs) >= 2:
            pick = min(rs, key=lambda r: r.predicted_s)
            best = min(r.measured_s for r in rs)
            regrets.append(pick.measured_s / best - 1)
    rhos = [v for v in rho.values() if v is not None]
    return {"rows": len(rows), "mean_abs_error": float(err.mean()),
            "median_abs_error": float(np.median(err)), "max_abs_error": float(err.max()),
            "too_fast": int(sum(r.error < 0 for r in rows)),
            "spearman_min": min(rhos) if rhos else None,
            "spearman_median": float(np.median(rhos)) if rhos else None,
            "spearman_by_model": {str(k): v for k, v in rho.items()},
            "regret_mean": float(np.mean(regrets)) if regrets else None,
            "regret_max": float(np.max(regrets)) if regrets else None,
            "groups": len(regrets)}


def kfold(n: int, k: int, seed: int = 0) -> list[np.ndarray]:
    """``k`` disjoint test index sets covering ``range(n)`` (shuffled with ``seed``)."""
    if not 2 <= k <= n:
        raise ValueError(f"k={k} folds need 2 <= k <= {n} rows")
    order = np.random.default_rng(seed).permutation(n)
    return [np.sort(part) for part in np.array_split(order, k)]


def holdout(items: Sequence, test: Callable[[object], bool]) -> tuple[list[int], list[int]]:
    """(train, test) indices: ``test(item)`` true goes to test."""
    tr, te = [], []
    for i, it in enumerate(items):
        (te if test(it) else tr).append(i)
    if not tr or not te:
        raise ValueError(f"the hold-out leaves {len(tr)} rows to fit and {len(te)} to test; "
                         "both must be non-empty")
    return tr, te
