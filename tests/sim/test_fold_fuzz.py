"""A seeded slice of benchmarks/fold_fuzz.py: random plans of every paradigm simulated as
`simulate` runs them (fold=auto, fast-forward) and with every rank and micro-batch agree on
the step time and every rank's peak (the full fuzz: python benchmarks/fold_fuzz.py)."""

from __future__ import annotations

import random
import warnings

import pytest

from benchmarks.fold_fuzz import both_ways, profiles, random_job


def _plans(seed: int, n: int):
    rng, out = random.Random(seed), []
    while len(out) < n:
        got = random_job(rng, 0.3)
        if got is not None and got[0].grid.world_size <= 16:
            out.append(got)
    return out


@pytest.mark.parametrize("seed", [101, 102])
def test_random_plans_fold_and_fast_forward_exactly(seed):
    costs = profiles()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for job, profile, what in _plans(seed, 12):
            full, fast = both_ways(job, costs.get(profile))
            assert fast["step_time_s"] == pytest.approx(full["step_time_s"], rel=1e-9), what
            peaks = fast["peak_memory_bytes"]
            assert all(peaks[r] == full["peak_memory_bytes"][r] for r in peaks), what
