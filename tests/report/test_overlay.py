"""Twin vs real: the join by (rank, step, op), residuals, and what an incomplete join says."""

from __future__ import annotations

import pytest

from twin.report import overlay
from twin.report import rundir as rd
from twin.report.build import overlay_pairs
from twin.trace import Trace


def test_two_runs_of_one_schedule_match_every_op(runs):
    a, b = rd.load(runs["single"]), rd.load(runs["jitter"])
    j = overlay.join(a.trace, b.trace)
    assert j.complete and len(j.pairs) == len(a.trace.spans) == len(b.trace.spans)
    assert "every op of each trace has its partner" in overlay.match_text(j, ("twin", "real"))
    res = overlay.residuals(j)
    assert {"gemm", "attention", "send", "recv", "all_gather (tp)"} <= set(res)
    gemm = res["gemm"]
    assert (gemm[:, 0] != gemm[:, 1]).any()  # jitter moved the durations


def test_runs_of_the_same_schedule_pair_up_and_others_do_not(runs):
    loaded = [rd.load(runs[k]) for k in ("single", "pp", "jitter")]
    pairs = overlay_pairs(loaded)
    assert [(a.name, b.name) for a, b in pairs] == [("single", "jitter")]


def test_missing_ops_are_counted_with_an_example(runs):
    a = rd.load(runs["single"]).trace
    b = Trace([s for s in a.spans if not (s.rank == 3 and s.kind == "gemm")], a.meta)
    j = overlay.join(a, b)
    n = sum(1 for s in a.spans if s.rank == 3 and s.kind == "gemm")
    assert not j.complete and len(j.only_a) == n and not j.only_b
    text = overlay.match_text(j, ("twin", "real"))
    assert f"{n:,} only in twin (e.g. rank 3" in text


def test_duplicate_keys_refuse_to_guess(runs):
    a = rd.load(runs["pp"]).trace
    with pytest.raises(ValueError, match="two spans for rank"):
        overlay.join(Trace(a.spans + a.spans[:1], a.meta), a)


def test_aligned_second_trace_starts_each_step_with_the_first(runs):
    a, b = rd.load(runs["single"]).trace, rd.load(runs["jitter"]).trace
    sa, sb = overlay.aligned(overlay.join(a, b))
    assert min(s.start_us for s in sa) == pytest.approx(min(s.start_us for s in sb))
    assert [s.op for s in sa] == [s.op for s in sb]
