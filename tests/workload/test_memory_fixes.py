"""What `paratwin inspect` suggests for a plan that does not fit: the single plan changes that
make it fit, each with the peak the memory model gives the changed job."""

from __future__ import annotations

import dataclasses

import pytest

from tests.conftest import cluster, gpt
from twin.spec import ParallelPlan, build_job
from twin.workload.summary import _changes, _peak, format_inspect, inspect_job, memory_fixes


def _tight(job, fraction: float):
    """``job`` on GPUs with ``fraction`` of its peak as HBM."""
    gpu = dataclasses.replace(job.cluster.gpu, hbm_GB=_peak(job) * fraction / 1e9)
    return dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, gpu=gpu))


def _job(**plan):
    """A small model at a long sequence: activations dominate its memory."""
    model = dataclasses.replace(gpt(), seq_len=8192)
    return build_job(model, cluster(), ParallelPlan(**{"global_batch_size": 8, **plan}))


def _rebuilt(job, changes: dict):
    fields = {k.removeprefix("parallel."): v for k, v in changes.items()}
    return dataclasses.replace(build_job(job.model, job.cluster,
                                         dataclasses.replace(job.parallel, **fields)),
                               cluster=job.cluster)


def test_a_plan_that_fits_needs_no_fix():
    assert memory_fixes(_job()) == []


def test_every_change_that_fits_is_listed_with_its_peak_and_no_other():
    job = _tight(_job(tp=2, micro_batch_size=2), 0.9)
    fixes = memory_fixes(job)
    hbm = job.cluster.hbm_bytes
    listed = [f["changes"] for f in fixes]
    assert fixes and all(f["fits"] for f in fixes)
    zero_listed = False
    for change in _changes(job):
        changes = {f"parallel.{k}": v for k, v in change.items()}
        peak = _peak(_rebuilt(job, changes))
        expected = peak <= hbm and not ("zero_stage" in change and zero_listed)
        assert (changes in listed) == expected
        zero_listed |= expected and "zero_stage" in change
        if changes in listed:
            assert fixes[listed.index(changes)]["peak_memory_bytes"] == pytest.approx(peak)
    assert 0 < len(listed) < len(_changes(job))  # some fit, some do not: both sides checked


def test_when_no_single_change_fits_all_of_them_are_tried_together():
    job = _tight(_job(tp=2, micro_batch_size=2), 0.2)
    fixes = memory_fixes(job)
    assert len(fixes) == 1 and not fixes[0]["fits"]
    together = fixes[0]["changes"]
    assert together["parallel.recompute"] == "full" and together["parallel.sp"] is True
    assert fixes[0]["peak_memory_bytes"] == pytest.approx(_peak(_rebuilt(job, together)))
    assert fixes[0]["peak_memory_bytes"] < _peak(job)


def test_the_text_names_the_fix():
    job = _tight(_job(tp=2, micro_batch_size=2), 0.9)
    rep = inspect_job(job)
    assert not rep["fits_memory"]
    rep["fixes"] = memory_fixes(job)
    text = format_inspect(rep)
    (field, value), = rep["fixes"][0]["changes"].items()
    assert f"fits with {field}={str(value).lower()} (" in text
    rep["fixes"] = memory_fixes(_tight(job, 0.2))
    assert "no change fits; all together: " in format_inspect(rep)


def test_of_the_zero_stages_that_fit_the_lowest_is_named():
    job = _tight(_job(tp=2, micro_batch_size=2), 0.985)
    zeros = [f["changes"]["parallel.zero_stage"] for f in memory_fixes(job)
             if "parallel.zero_stage" in f["changes"]]
    fitting = [c["zero_stage"] for c in _changes(job) if "zero_stage" in c
               and _peak(_rebuilt(job, {"parallel.zero_stage": c["zero_stage"]}))
               <= job.cluster.hbm_bytes]
    assert len(fitting) >= 2 and zeros == [min(fitting)]


def test_a_change_the_plan_cannot_take_is_left_out_of_the_combination():
    """Experts sharded over EP refuse ZeRO-3 (build_job): with nothing fitting, all the other
    changes are still tried together."""
    from twin.spec.moe import MoESpec

    moe = MoESpec(num_experts=4, experts_per_token=2, moe_ffn_hidden_size=512)
    model = dataclasses.replace(gpt(activation="swiglu", moe=moe), seq_len=8192)
    job = build_job(model, cluster(), ParallelPlan(ep=2, global_batch_size=16, micro_batch_size=2))
    job = _tight(job, 0.2)
    fixes = memory_fixes(job)
    assert len(fixes) == 1 and not fixes[0]["fits"]
    assert fixes[0]["changes"]["parallel.zero_stage"] == 2
    assert fixes[0]["changes"]["parallel.recompute"] == "full"
