"""Split-backward pipeline tables (ZB-H1, ZB-V, DualPipeV): closed-form bubbles, invariants,
V placement, and torch 2.13's own action orders."""

from __future__ import annotations

from collections import Counter

import pytest

from twin.schedule.pipeline import (
    chunk_stage,
    ideal_makespan,
    peak_in_flight,
    run_tables,
    stage_chunks,
)
from twin.schedule.tables import stage_table


def tables(name: str, p: int, m: int, v: int = 1):
    return [stage_table(name, p, m, s, v) for s in range(p)]


# -- closed forms: the bubble (idle time of a stage) with fixed F, B, W and free comms -----

@pytest.mark.parametrize("p, m", [(2, 4), (3, 9), (4, 8), (4, 16), (8, 24), (5, 7)])
@pytest.mark.parametrize("t_f, t_b", [(1.0, 2.0), (2.0, 3.0), (1.0, 3.5)])
def test_1f1b_bubble_is_p_minus_1_times_f_plus_b(p, m, t_f, t_b):
    run = run_tables(tables("1f1b", p, m), 1, t_f, t_b)
    for s in range(p):
        assert run.idle(s) == pytest.approx((p - 1) * (t_f + t_b))


@pytest.mark.parametrize("p, m", [(2, 2), (2, 4), (3, 9), (4, 4), (4, 8), (4, 11), (8, 24)])
@pytest.mark.parametrize("t_f, t_b, t_w", [(1, 2, 1), (1, 2, 0.5), (1, 3, 1), (2, 3, 1.5),
                                           (1, 2, 0.8), (3, 2, 1)])
def test_zb_h1_bubble_is_p_minus_1_times_f_plus_b_minus_2w(p, m, t_f, t_b, t_w):
    """Qi et al. 2023, §3.1: (p - 1)(T_F + T_B - 2 T_W) with B the whole backward (their
    T_F + T_B - T_W with B = I alone), on every stage, for m >= p and W <= F."""
    run = run_tables(tables("zb_h1", p, m), 1, t_f, t_b, t_w)
    for s in range(p):
        assert run.idle(s) == pytest.approx((p - 1) * (t_f + t_b - 2 * t_w))


def test_zb_h1_with_equal_f_i_w_has_a_third_of_the_1f1b_bubble():
    p, m = 4, 12
    zb = ideal_makespan(tables("zb_h1", p, m), p, 1, 1.0, 2.0, 1.0) - 3 * m
    one = ideal_makespan(tables("1f1b", p, m), p, 1, 1.0, 2.0) - 3 * m
    assert zb == pytest.approx(one / 3)


@pytest.mark.parametrize("p", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("extra", [0, 1, 5, 2])  # m = 2p + extra
@pytest.mark.parametrize("t_f", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("fb_over_f", [2.0, 2.2, 2.5, 3.0])  # F&B from B (full overlap) to F + B
def test_dualpipev_bubble_is_p_minus_1_times_fb_plus_b_minus_3w(p, extra, t_f, fb_over_f):
    """DeepSeek's DualPipe README: (PP/2 - 1)(F&B + B - 3W) with PP = 2p chunks and chunk
    times B = 2F, W = F (its figure's proportions); the most idle stage has exactly that."""
    m = 2 * p + extra
    f, b, w, fb = t_f, 2 * t_f, t_f, fb_over_f * t_f  # one chunk's times
    run = run_tables(tables("dualpipev", p, m, 2), 2, 2 * f, 2 * b, 2 * w, 2 * fb)
    assert max(run.idle(s) for s in range(p)) == pytest.approx((p - 1) * (fb + b - 3 * w))


def test_dualpipev_overlap_shortens_the_step():
    p, m = 4, 16
    sequential = ideal_makespan(tables("dualpipev", p, m, 2), p, 2, 2.0, 4.0, 2.0)
    overlapped = ideal_makespan(tables("dualpipev", p, m, 2), p, 2, 2.0, 4.0, 2.0, t_fb=4.0)
    assert overlapped < sequential


@pytest.mark.parametrize("p, m", [(2, 4), (3, 9), (4, 8), (4, 16), (8, 16)])
def test_zb_v_reaches_the_startup_bound_when_f_i_w_are_equal(p, m):
    """Rank i cannot start before i chunk forwards have run: every rank idles at least
    (p - 1) F (equal work, one makespan). With F = I = W ZB-V idles exactly that (torch:
    "zero bubble only if time forward == time backward input == time backward weights")."""
    run = run_tables(tables("zb_v", p, m, 2), 2, 2.0, 4.0, 2.0)
    for s in range(p):
        assert run.idle(s) == pytest.approx(p - 1)
    one = run_tables(tables("1f1b", p, m), 1, 2.0, 4.0)
    assert run.makespan < one.makespan


# -- invariants ---------------------------------------------------------------------------

CASES = [("zb_h1", 1, 4, 1), ("zb_h1", 4, 8, 1), ("zb_h1", 4, 3, 1), ("zb_h1", 8, 20, 1),
         ("zb_v", 1, 3, 2), ("zb_v", 2, 4, 2), ("zb_v", 4, 8, 2), ("zb_v", 4, 3, 2),
         ("zb_v", 8, 9, 2), ("dualpipev", 1, 2, 2), ("dualpipev", 2, 4, 2),
         ("dualpipev", 4, 8, 2), ("dualpipev", 4, 13, 2), ("dualpipev", 8, 16, 2)]


@pytest.mark.parametrize("name, p, m, v", CASES)
def test_every_chunk_runs_one_forward_and_one_backward(name, p, m, v):
    style = "v" if name != "zb_h1" else "loop"
    for s, order in enumerate(tables(name, p, m, v)):
        count = Counter((a.phase, a.mb, a.chunk) for a in order)
        assert all(n == 1 for n in count.values()), f"stage {s}: an action twice"
        for c in stage_chunks(s, p, v, style):
            for mb in range(m):
                assert count[("F", mb, c)] == 1
                whole, inp, wgt = (count[(x, mb, c)] for x in "BIW")
                assert (whole, inp, wgt) in ((1, 0, 0), (0, 1, 1)), (s, mb, c)
        assert {a.chunk for a in order} == set(stage_chunks(s, p, v, style))


@pytest.mark.parametrize("name, p, m, v", CASES)
def test_w_after_its_i_and_backward_after_forward(name, p, m, v):
    for order in tables(name, p, m, v):
        seen = set()
        for a in order:
            if a.phase in ("B", "I"):
                assert ("F", a.mb, a.chunk) in seen
            if a.phase == "W":
                assert ("I", a.mb, a.chunk) in seen
            seen.add((a.phase, a.mb, a.chunk))


@pytest.mark.parametrize("name, p, m, v", CASES)
def test_tables_never_deadlock(name, p, m, v):
    run = run_tables(tables(name, p, m, v), v)
    assert len(run.end) == sum(len(o) for o in tables(name, p, m, v))
    for (phase, mb, c), t in run.end.items():  # every dependency ended before
        if phase == "F" and c > 0:
            assert run.end[("F", mb, c - 1)] < t + 1e-12


def test_a_deadlocking_table_names_its_blocked_actions():
    orders = tables("1f1b", 2, 2)
    orders[1] = [orders[1][1]] + [orders[1][0]] + orders[1][2:]  # B0 before F0 on the last stage
    with pytest.raises(RuntimeError, match="stage 1: B0 of chunk 1"):
        run_tables(orders, 1)


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 16), (8, 8), (8, 24), (4, 2)])
def test_zb_h1_holds_the_activations_of_1f1b(p, m):
    """ZB-H1 keeps 1F1B's peak: min(p, m) micro-batches (on every stage, where 1F1B holds
    p - i on stage i); W delayed on later stages uses the memory the earlier ones need."""
    zb = [peak_in_flight(o) for o in tables("zb_h1", p, m)]
    one = [peak_in_flight(o) for o in tables("1f1b", p, m)]
    assert max(zb) == max(one) == min(p, m)
    assert zb == [min(p, m)] * p


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 16), (8, 24)])
def test_zb_v_holds_2p_half_chunks_and_dualpipev_one_more(p, m):
    """ZB-V: 2p chunk micro-batches of half a stage each = 1F1B's p (Qi et al. §6);
    DualPipeV: PP + 1 = 2p + 1 chunks (DualPipe README's activation column)."""
    assert [peak_in_flight(o) for o in tables("zb_v", p, m, 2)] == [2 * p] * p
    assert [peak_in_flight(o) for o in tables("dualpipev", p, m, 2)] == [2 * p + 1] * p


# -- placement -------------------------------------------------------------------------------

def test_v_placement_puts_chunk_i_and_2p_minus_1_minus_i_on_rank_i():
    p = 4
    assert [chunk_stage(c, p, "v") for c in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [chunk_stage(c, p) for c in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert stage_chunks(1, p, 2, "v") == [1, 6] and stage_chunks(1, p, 2) == [1, 5]


# -- torch 2.13's own tables -------------------------------------------------------------------

def _torch_tables(name: str, p: int, m: int):
    """torch's per-rank compute actions (its alignment slots dropped) as our Actions."""
    from types import SimpleNamespace

    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    from twin.schedule.pipeline import Action, Overlapped

    if name == "zb_h1":
        rounds = max(1, m // p)
        cls = schedules.ScheduleInterleavedZeroBubble
        fake = SimpleNamespace(n_local_stages=1, microbatches_per_round=m // rounds,
                               pp_group_size=p, _n_microbatches=m)
    elif name == "zb_v":
        cls = schedules.ScheduleZBVZeroBubble
        fake = SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=2 * p)
    else:
        cls = schedules.ScheduleDualPipeV
        fake = SimpleNamespace(pp_group_size=p, _n_microbatches=m)
    out = []
    for r in range(p):
        row = []
        for a in cls._calculate_single_rank_operations(fake, r):
            if a is None:
                continue
            if a.sub_actions:
                f, b = a.sub_actions
                row.append(Overlapped("F", f.microbatch_index, f.stage_index))
                row.append(Action(b.computation_type.value, b.microbatch_index, b.stage_index))
            else:
                row.append(Action(a.computation_type.value, a.microbatch_index, a.stage_index))
        out.append(row)
    return out


@pytest.mark.parametrize("name", ["zb_h1", "zb_v", "dualpipev"])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_tables_match_torch_2_13(name, p):
    ms = range(2 * p, 4 * p + 2) if name == "dualpipev" else range(1, 3 * p + 2)
    for m in ms:
        ours = tables(name, p, m, 1 if name == "zb_h1" else 2)
        theirs = _torch_tables(name, p, m)
        assert ours == theirs, (p, m)
        assert [[a.overlap for a in r] for r in ours] == [[a.overlap for a in r] for r in theirs]
