"""A seeded slice of benchmarks/fold_fuzz.py: random plans of every paradigm simulated as
`simulate` runs them (fold=auto, fast-forward) and with every rank and micro-batch agree on
the step time and every rank's peak (the full fuzz: python benchmarks/fold_fuzz.py)."""

from __future__ import annotations

import random
import warnings

import pytest

from benchmarks.fold_fuzz import random_job
from paratwin.config import CONF_DIR
from twin.cost import CostModel
from twin.sim.engine import SimOptions
from twin.sim.run import simulate


def _plans(seed: int, n: int):
    rng, out = random.Random(seed), []
    while len(out) < n:
        got = random_job(rng, 0.3)
        if got is not None and got[0].grid.world_size <= 16:
            out.append(got)
    return out


@pytest.mark.parametrize("seed", [101, 102])
def test_random_plans_fold_and_fast_forward_exactly(seed):
    profiles = {n: CostModel.load(CONF_DIR / "profiles" / f"{n}.yaml")
                for n in ("dgx_h100", "dgx_a100")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for job, profile, what in _plans(seed, 12):
            full, fast = (simulate(job, profiles.get(profile), SimOptions(fold=f, fast_forward=ff),
                                   trace="none").summary
                          for f, ff in (("none", False), ("auto", True)))
            assert fast["step_time_s"] == pytest.approx(full["step_time_s"], rel=1e-9), what
            peaks = fast["peak_memory_bytes"]
            assert all(peaks[r] == full["peak_memory_bytes"][r] for r in peaks), what
