"""Collectives beside busy cores (twin.calibrate.busy): how many ranks computed during a
call, and the wait estimated from calls measured both ways."""

from __future__ import annotations

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
