"""Collectives beside busy cores: ranks that share a host's CPU cores hand each collective to
a thread of the process group (gloo's); when every core is computing, that thread is woken
into a full run queue and waits for a time slice before the call can move. Measured on this
machine (2 cores, 2 ranks): a 1 KB all-reduce takes 0.6 ms while the ranks wait for it and
4.7 ms while both compute beside it; mid-size all-reduces and reduce-scatters 1.9 ms more
(about half a 4 ms scheduler tick a hand-off).

``node_compute`` and ``computing`` tell, from a traced run, how many ranks computed during a
call; ``busy_handoff`` estimates the wait from calls of one kind, size and group that ran
both ways (the twin adds it to a call that starts while its node's cores all compute:
``CostModel.busy_handoff_us``), so that the collective fits see every call as if alone.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import numpy as np

from twin.calibrate.fit import weighted_median

BUSY_SHARE = 0.75
"""A call ran beside busy cores when on average at least this share of its node's cores
computed during it (the ranks' compute spans over the call, summed)."""
LATENCY_BYTES = 1 << 20
"""Only calls up to this size estimate the wait: larger ones also share the cores' bandwidth
with the compute beside them, which the twin's fabric models apart."""
MIN_CALLS = 2
"""Calls of a (kind, size, group) needed on each side, busy and not, to use their difference."""


def node_compute(spans: Iterable, node_of) -> dict[tuple[int, int], np.ndarray]:
    """(step, node) -> [start, end] of every compute span there, sorted by start."""
    out: dict[tuple[int, int], list] = defaultdict(list)
    for s in spans:
        if s.stream == "compute":
            out[(s.step, node_of(s.rank))].append((s.start_us, s.end_us))
    return {k: np.array(sorted(v)) for k, v in out.items()}


def computing(intervals: np.ndarray | None, start: float, end: float) -> float:
    """Ranks computing on average over [start, end]: the compute spans' overlap with it,
    summed, over its length."""
    if intervals is None or not len(intervals) or end <= start:
        return 0.0
    lo = np.maximum(intervals[:, 0], start)
    hi = np.minimum(intervals[:, 1], end)
    return float(np.clip(hi - lo, 0.0, None).sum() / (end - start))


def busy_handoff(calls: dict[tuple, list[tuple[float, bool]]]) -> tuple[float | None, int]:
    """(the wait in seconds, how many call kinds and sizes gave it; None when none could):
    per (kind, group size, bytes, role) of at most LATENCY_BYTES with MIN_CALLS calls beside
    busy cores and as many without, the difference of their means; the median of those,
    weighted by the fewer side's calls, and never below 0. ``calls``: key -> (seconds, busy)."""
    diffs, weights = [], []
    for key, got in calls.items():
        if key[2] > LATENCY_BYTES:
            continue
        busy = [t for t, b in got if b]
        alone = [t for t, b in got if not b]
        if len(busy) >= MIN_CALLS and len(alone) >= MIN_CALLS:
            diffs.append(float(np.mean(busy) - np.mean(alone)))
            weights.append(min(len(busy), len(alone)))
    if not diffs:
        return None, 0
    return max(0.0, weighted_median(diffs, weights)), len(diffs)
