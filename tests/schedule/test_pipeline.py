"""Pipeline tables: every action once, warm-up/steady/cool-down counts, ideal bubbles."""

from __future__ import annotations

import pytest

from twin.schedule.pipeline import ideal_makespan, interleaved, one_f_one_b, stage_order


def _warmup(order):
    """Forwards before the first backward."""
    return next(i for i, a in enumerate(order) if a.phase == "B")


@pytest.mark.parametrize("name, p, m, v", [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1),
                                           ("1f1b", 8, 8, 1), ("interleaved", 4, 8, 2),
                                           ("interleaved", 2, 4, 3), ("1f1b", 1, 5, 1)])
def test_every_action_once_and_backward_after_forward(name, p, m, v):
    for s in range(p):
        order = stage_order(name, p, m, s, v)
        chunks = [s + c * p for c in range(v)]
        assert sorted(order) == sorted((ph, mb, c) for ph in "BF" for mb in range(m)
                                       for c in chunks)
        seen = set()
        for a in order:
            if a.phase == "B":
                assert ("F", a.mb, a.chunk) in seen
            seen.add(tuple(a))


@pytest.mark.parametrize("p, m", [(4, 8), (8, 16), (4, 4)])
def test_1f1b_phases(p, m):
    for s in range(p):
        order = one_f_one_b(p, m, s)
        warm = min(p - s - 1, m)
        assert _warmup(order) == warm + 1  # warm-up forwards, then the first steady forward
        steady = order[warm: warm + 2 * (m - warm)]
        assert [a.phase for a in steady] == ["F", "B"] * (m - warm)
        cool = order[warm + 2 * (m - warm):]
        assert len(cool) == warm and all(a.phase == "B" for a in cool)
        # in flight at the peak: p - s micro-batches (Narayanan §2.2.1)
        live = peak = 0
        for a in order:
            live += 1 if a.phase == "F" else -1
            peak = max(peak, live)
        assert peak == min(m, p - s)


@pytest.mark.parametrize("p, m, v", [(4, 8, 2), (4, 4, 4), (2, 6, 3)])
def test_interleaved_phases(p, m, v):
    for s in range(p):
        order = interleaved(p, m, s, v)
        warm = min(2 * (p - s - 1) + (v - 1) * p, m * v)
        assert all(a.phase == "F" for a in order[:warm])
        steady = order[warm: warm + 2 * (m * v - warm)]
        assert [a.phase for a in steady] == ["F", "B"] * (m * v - warm)
        assert all(a.phase == "B" for a in order[warm + 2 * (m * v - warm):])
        # forwards run micro-batches in groups of p through chunk 0, then chunk 1, ...
        fwd = [a for a in order if a.phase == "F"]
        assert [a.chunk for a in fwd[:p]] == [s] * p
        assert [a.mb for a in fwd[:p]] == list(range(p))


@pytest.mark.parametrize("name, p, m", [("gpipe", 4, 8), ("1f1b", 4, 8), ("1f1b", 8, 16),
                                        ("gpipe", 2, 3), ("1f1b", 3, 9),
                                        ("1f1b", 4, 2), ("1f1b", 8, 1)])  # m < p: fill/drain
def test_bubble_fraction_is_p_minus_1_over_m(name, p, m):
    # Narayanan et al. 2021 §2.2.1: bubble time / ideal time = (p - 1) / m
    orders = [stage_order(name, p, m, s) for s in range(p)]
    t = ideal_makespan(orders, p, 1)
    assert (t - 3 * m) / (3 * m) == pytest.approx((p - 1) / m)


@pytest.mark.parametrize("p, m, v", [(4, 8, 2), (4, 4, 3), (8, 16, 4), (2, 8, 2)])
def test_interleaved_bubble_fraction_is_divided_by_v(p, m, v):
    # §2.2.2: (1/v) (p - 1) / m
    orders = [stage_order("interleaved", p, m, s, v) for s in range(p)]
    t = ideal_makespan(orders, p, v)
    assert (t - 3 * m) / (3 * m) == pytest.approx((p - 1) / (v * m))


def test_gpipe_and_1f1b_take_the_same_time():
    p, m = 4, 12
    t = [ideal_makespan([stage_order(n, p, m, s) for s in range(p)], p, 1)
         for n in ("gpipe", "1f1b")]
    assert t[0] == t[1]
