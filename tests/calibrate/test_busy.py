"""Collectives beside busy cores (twin.calibrate.busy): how many ranks computed during a
call, and the wait estimated from calls measured both ways."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from twin.calibrate.busy import LATENCY_BYTES, busy_handoff, computing, node_compute
from twin.trace import Span


def test_computing_is_the_compute_spans_overlap_over_the_call():
    spans = np.array([[0.0, 10.0], [5.0, 15.0]])
    assert computing(spans, 5.0, 10.0) == pytest.approx(2.0)  # both ranks throughout
    assert computing(spans, 10.0, 20.0) == pytest.approx(0.5)  # one rank, half the call
    assert computing(spans, 20.0, 30.0) == 0.0
    assert computing(None, 0.0, 1.0) == 0.0 and computing(spans, 3.0, 3.0) == 0.0


def test_node_compute_keeps_compute_spans_by_step_and_node():
    def span(rank, step, stream, a, b):
        return Span(rank, step, "x", "gemm", stream, a, b)

    got = node_compute([span(0, 0, "compute", 5, 6), span(1, 0, "compute", 1, 2),
                        span(2, 0, "compute", 0, 1), span(0, 0, "comm", 0, 9),
                        span(0, 1, "compute", 3, 4)], lambda r: r // 2)
    assert sorted(got) == [(0, 0), (0, 1), (1, 0)]
    assert got[(0, 0)].tolist() == [[1, 2], [5, 6]]  # sorted, the comm span left out


def test_the_wait_is_the_weighted_median_of_busy_minus_alone():
    calls = {("all_reduce", 2, 1024, ""): [(3.0, True)] * 2 + [(1.0, False)] * 2,      # +2, weight 2
             ("all_reduce", 2, 4096, ""): [(2.5, True)] * 3 + [(1.0, False)] * 5,      # +1.5, weight 3
             ("all_gather", 2, 8192, ""): [(9.0, True)] * 1 + [(1.0, False)] * 9,      # one busy call
             ("all_reduce", 2, 2 * LATENCY_BYTES, ""): [(9.0, True)] * 9 + [(1.0, False)] * 9}
    assert busy_handoff(calls) == (pytest.approx(1.5), 2)
    calls[("reduce_scatter", 2, 64, "")] = [(4.0, True)] * 9 + [(1.0, False)] * 9  # +3, weight 9
    assert busy_handoff(calls) == (pytest.approx(3.0), 3)


def test_no_call_measured_both_ways_gives_none_and_a_faster_busy_side_gives_zero():
    assert busy_handoff({("all_reduce", 2, 64, ""): [(1.0, True)] * 5}) == (None, 0)
    assert busy_handoff({}) == (None, 0)
    calls = {("all_reduce", 2, 64, ""): [(1.0, True)] * 3 + [(2.0, False)] * 3}
    assert busy_handoff(calls) == (0.0, 1)


def _traced_run(tmp_path, wait_us: float, steps: int = 3):
    """Two ranks on two shared cores, simulated with ``busy_handoff_us`` = ``wait_us`` and
    read back as a measured run: each round a 1 KB all-reduce issued beside a 10 ms GEMM on
    both ranks (busy), then one the ranks wait for (alone), then a quiet GEMM."""
    from tests.sim.test_busy_handoff import _host
    from tests.sim.test_mechanisms import _cost, _gemm
    from twin.calibrate.traces import TracedRun
    from twin.schedule.ir import Op, Program
    from twin.sim.engine import SimOptions, Simulation

    def ar(name, dep):
        return Op(name=name, kind="all_reduce", stream="comm", group=(0, 1), group_name="dp",
                  bytes=1024.0, deps=(dep,))

    ops: list[Op] = []
    for k in range(6):
        prev = (len(ops) - 1,) if ops else ()
        a = len(ops)
        ops += [_gemm(f"a{k}", 1e-3, prev), _gemm(f"b{k}", 1e-2, (a,)), ar(f"busy{k}", a)]
        ops += [ar(f"alone{k}", a + 1), _gemm(f"c{k}", 2e-3 * (1 + k % 3), (a + 3,))]
    cost = dataclasses.replace(_cost(), busy_handoff_us=wait_us)
    job = _host(2)
    progs = {r: Program(r, [dataclasses.replace(op) for op in ops]) for r in (0, 1)}
    sim = Simulation(job, progs, cost, SimOptions(), {0: [0], 1: [1]})
    step = sim.run()
    spans = [Span.of(op, r, s, (sim.start[r][i] + s * step) * 1e6, (sim.end[r][i] + s * step) * 1e6)
             for s in range(steps) for r in (0, 1) for i, op in enumerate(progs[r].ops)]
    return TracedRun(tmp_path, job, spans, {(r, op.name): op for r in (0, 1) for op in ops},
                     {r: progs[r].ops for r in (0, 1)}, step, step, step), sim


@pytest.mark.parametrize("wait_us", [0.0, 700.0])
def test_the_fit_recovers_the_wait_and_the_call_without_it(tmp_path, wait_us):
    from twin.calibrate.traces import fit_traces, measurements

    run, sim = _traced_run(tmp_path, wait_us)
    busy = [float(sim.end[0][i] - sim.start[0][i]) for i, op in enumerate(sim.programs[0].ops)
            if op.name.startswith("busy")]
    alone = [float(sim.end[0][i] - sim.start[0][i]) for i, op in enumerate(sim.programs[0].ops)
             if op.name.startswith("alone")]
    assert np.mean(busy) - np.mean(alone) == pytest.approx(wait_us * 1e-6, abs=2e-6)
    _, rows, *_, beside = measurements([run])
    assert beside["sizes"] == 1 and beside["us"] == pytest.approx(wait_us, abs=2.0)
    # the busy calls' wait is taken off what the collective fits see: every call as if alone
    (pooled,) = [r for r in rows if r["role"] == ""]
    assert pooled["samples"] == 36 and pooled["time_s_median"] == pytest.approx(np.mean(alone), abs=2e-6)
    assert pooled["time_s_p90"] - pooled["time_s_p10"] < 2e-6
    profile, report = fit_traces([run], "fitted", sim.cost)
    assert profile.busy_handoff_us == pytest.approx(wait_us, abs=2.0)
    assert report["busy_handoff_us"]["us"] == pytest.approx(wait_us, abs=2.0)
