"""Step timing and the per-kind profile of conformance runs, on fabricated numbers (no process)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

pytest.importorskip("torch")

from executor.conformance.runner import step_timing  # noqa: E402
from executor.conformance.train import OPT_RANGE, classify_events, op_kind  # noqa: E402


def test_step_time_is_the_largest_rank_per_step_after_warmup():
    times = {0: [9.0, 1.0, 2.0, 3.0, 4.0, 50.0], 1: [8.0, 1.5, 1.0, 3.5, 2.0, 60.0]}
    t = step_timing(times, warmup=1, profile_step=5)
    assert t["steps_measured"] == [1, 2, 3, 4]  # the warm-up and the profiled step left out
    assert t["step_times_s"] == [1.5, 2.0, 3.5, 4.0]
    assert t["step_time_s"] == t["step_time_p50_s"] == pytest.approx(2.75)
    assert t["step_time_p10_s"] == 1.5 and t["step_time_p90_s"] == 4.0
    assert t["per_rank_median_s"] == {"0": 2.5, "1": 1.75}
    assert t["measured_steps"] == 4 and t["warmup"] == 1 and t["profile"] is None


def test_profiles_are_summed_over_ranks():
    prof = {0: {"step_s": 1.0, "kinds": {"gemm": 0.5, "optimizer": 0.1}, "events": 3},
            1: {"step_s": 1.2, "kinds": {"gemm": 0.25, "optimizer": 0.2}, "events": 3}}
    t = step_timing({0: [1.0, 1.0, 1.0], 1: [1.0, 1.0, 1.0]}, 1, 2, prof)
    assert t["profile"]["kinds"] == pytest.approx({"gemm": 0.75, "optimizer": 0.3})
    assert t["profile"]["step_s"] == 1.2 and set(t["profile"]["ranks"]) == {"0", "1"}


def test_no_measured_step_is_an_error():
    with pytest.raises(ValueError, match="no measured step"):
        step_timing({0: [1.0, 2.0]}, warmup=1, profile_step=1)


@dataclass
class Ev:
    name: str
    self_cpu_time_total: float  # us
    cpu_parent: Ev | None = None


def test_events_are_classified_by_name_and_by_the_optimizer_range():
    opt = Ev(OPT_RANGE, 10.0)
    adam = Ev("Optimizer.step#AdamW.step", 20.0, opt)
    events = [
        Ev("aten::mm", 1000.0), Ev("aten::addmm", 500.0),
        Ev("aten::_scaled_dot_product_flash_attention_for_cpu", 300.0),
        Ev("aten::_softmax", 100.0), Ev("aten::_log_softmax", 50.0),  # the loss: elementwise
        Ev("aten::mul", 40.0), Ev("c10d::allreduce_", 30.0),
        Ev("autograd::engine::evaluate_function: MmBackward0", 25.0),
        opt, adam, Ev("aten::lerp_", 200.0, adam), Ev("aten::mul_", 100.0, adam),
        Ev("c10d::allreduce_", 5.0, opt),  # the clip's all-reduce stays a collective
    ]
    got = classify_events(events)
    assert got == pytest.approx({"gemm": 1.5e-3, "attention": 0.4e-3, "elementwise": 0.09e-3,
                                 "optimizer": 0.33e-3, "collectives": 0.035e-3,
                                 "framework": 0.025e-3})
    assert op_kind("gloo:all_reduce", False) == "collectives"
    assert op_kind("aten::bmm", True) == "optimizer"
