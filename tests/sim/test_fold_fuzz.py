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


def test_the_host_resumes_after_a_call_that_ended_the_instant_it_synced():
    """Found by the fuzz (seed 1): under host syncs (the dgx_a100 profile), a sync point
    whose last call completed at the instant the host reached it read the call's end before
    the call's stream wrote it, so the unfolded run resumed the host early (6.4e-6 of the
    step) while the folded run, where the call is timed privately, did not."""
    import dataclasses

    from paratwin.config import preset_cluster
    from twin.sim.engine import SimOptions
    from twin.sim.run import simulate
    from twin.spec import ModelSpec, ParallelPlan, build_job

    model = ModelSpec(name="fuzz", num_layers=4, hidden_size=128, num_heads=8, num_kv_heads=2,
                      ffn_hidden_size=512, vocab_size=1000, seq_len=64, activation="gelu")
    a100 = preset_cluster("dgx_a100")
    cluster = dataclasses.replace(a100, num_nodes=2, inter=dataclasses.replace(a100.inter, nics_per_node=1))
    plan = ParallelPlan(tp=4, pp=2, cp=2, sp=True, async_tp=True, compile=True, pp_schedule="zb_h1",
                        global_batch_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        job = build_job(model, cluster, plan)
        steps = [simulate(job, profiles()["dgx_a100"], SimOptions(fold=fold, fast_forward=False),
                          trace="none").summary["step_time_s"] for fold in ("none", "tp")]
    assert steps[1] == pytest.approx(steps[0], rel=1e-12)
