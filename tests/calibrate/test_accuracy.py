"""Accuracy figures of run predictions: errors, Spearman per model, regret per group, folds."""

from __future__ import annotations

import numpy as np
import pytest

from twin.calibrate.accuracy import Scored, holdout, kfold, score


def test_errors_rank_and_regret_by_hand():
    rows = [Scored("m", "g", 1.0, 1.1), Scored("m", "g", 2.0, 1.0), Scored("m", "g", 3.0, 3.3),
            Scored("n", "h", 1.0, 0.5), Scored("n", "h", 4.0, 4.0), Scored("n", "h", 2.0, 3.0)]
    s = score(rows)
    assert s["mean_abs_error"] == pytest.approx((0.1 + 0.5 + 0.1 + 0.5 + 0 + 0.5) / 6)
    assert s["max_abs_error"] == pytest.approx(0.5) and s["too_fast"] == 2
    # m: measured 1,2,3 vs predicted 1.1,1.0,3.3 -> ranks (1,2,3) vs (2,1,3): rho = 0.5
    assert s["spearman_by_model"]["m"] == pytest.approx(0.5)
    assert s["spearman_by_model"]["n"] == pytest.approx(1.0)
    # g: the twin picks the 2.0 s plan (predicted 1.0); best measured 1.0 -> regret 1.0; h: 0
    assert s["regret_max"] == pytest.approx(1.0) and s["regret_mean"] == pytest.approx(0.5)


def test_folds_partition_the_rows_and_holdout_splits():
    folds = kfold(11, 5, seed=3)
    assert sorted(np.concatenate(folds).tolist()) == list(range(11))
    assert [len(f) for f in folds] == [3, 2, 2, 2, 2]
    tr, te = holdout([1024, 2048, 1024], lambda h: h == 2048)
    assert (tr, te) == ([0, 2], [1])
    with pytest.raises(ValueError, match="both must be non-empty"):
        holdout([1, 1], lambda x: x == 2)
