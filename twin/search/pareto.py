"""The Pareto front of plans: throughput up, GPUs down, memory per GPU down.

A plan is on the front when no other plan is at least as good on all three and better on
one (more tokens/s, no more GPUs, no more peak memory). Plans sorted by throughput
(best first) are compared only with the front found so far: O(n * front).
"""

from __future__ import annotations

from collections.abc import Sequence


def dominates(a: tuple[float, float, float], b: tuple[float, float, float]) -> bool:
    """(tokens/s, GPUs, peak bytes): ``a`` at least as good on all and better on one."""
    return a[0] >= b[0] and a[1] <= b[1] and a[2] <= b[2] and a != b


def pareto_front(points: Sequence[tuple[float, float, float]]) -> list[int]:
    """Indices of the non-dominated points of (tokens/s, GPUs, peak bytes), by throughput
    (best first); of equal points, the first."""
    order = sorted(range(len(points)), key=lambda i: (-points[i][0], points[i][1], points[i][2]))
    front: list[int] = []
    for i in order:
        p = points[i]
        if not any(dominates(points[j], p) or points[j] == p for j in front):
            front.append(i)
    return front


def spread(front: Sequence[int], points: Sequence[tuple[float, float, float]], k: int) -> list[int]:
    """At most ``k`` of the front's indices spread evenly over its memory range (both ends
    included), in the front's order: a few points of a long front to simulate."""
    if k <= 0 or not front:
        return []
    if len(front) <= k:
        return list(front)
    by_mem = sorted(front, key=lambda i: (points[i][2], -points[i][0]))
    picks = {by_mem[round(j * (len(by_mem) - 1) / (k - 1))] for j in range(k)} if k > 1 \
        else {front[0]}
    return [i for i in front if i in picks]
