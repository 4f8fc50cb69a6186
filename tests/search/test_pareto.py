"""The Pareto front: exactly the plans no other plan beats on throughput, GPUs and memory."""

from __future__ import annotations

import random

from twin.search.pareto import dominates, pareto_front, spread


def test_front_is_the_non_dominated_points():
    rng = random.Random(3)
    points = [(rng.choice([1.0, 2.0, 3.0, 4.0]) * rng.random(), rng.choice([8, 16, 32]),
               rng.choice([10.0, 20.0, 40.0])) for _ in range(300)]
    points += points[:5]  # equal points: one of each on the front
    front = pareto_front(points)
    brute = {points[i] for i in range(len(points))
             if not any(dominates(q, points[i]) for q in points)}
    assert {points[i] for i in front} == brute
    assert len(front) == len(brute)
    assert [points[i][0] for i in front] == sorted((points[i][0] for i in front), reverse=True)


def test_spread_keeps_both_ends_of_the_memory_range():
    points = [(float(k), 8, float(k)) for k in range(10)]  # faster plans take more memory
    front = pareto_front(points)
    assert len(front) == 10
    picked = spread(front, points, 3)
    assert len(picked) == 3 and {points[i][2] for i in picked} >= {0.0, 9.0}
    assert spread(front, points, 20) == front and spread(front, points, 0) == []
