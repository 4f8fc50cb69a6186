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
    for change in _changes(job):
        changes = {f"parallel.{k}": v for k, v in change.items()}
        peak = _peak(_rebuilt(job, changes))
        assert (changes in listed) == (peak <= hbm)
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
