"""The pipeline part of the estimate: m micro-batches of the slowest stage plus the schedule's
fill and drain, in closed form or from the schedule's own table.

Per stage s a micro-batch costs W_s = F_s + B_s (+ its exchanges), B_s = I_s + W_s of which
the weight-gradient GEMMs W_s can move under a split backward. With v chunks per stage:

    1F1B, GPipe, interleaved: T = m max_s W_s + (sum_s W_s - max_s W_s) / v
        (Narayanan et al. 2021, §2.2: bubble (p - 1) / v of a micro-batch's time)
    ZB-H1: T = m max W + (p - 1) (F + B - 2 W)        (Qi et al. 2024, §3.1, Table 1;
           m >= p; with fewer, 1F1B's T less (p - 1) W: the later stages' W off the path)
    ZB-V, DualPipeV: T = m (F + B) + their tables' bubble

with F, B, W those of the slowest stage. ZB-V's and DualPipeV's bubble is the walk of
their tables (``twin.schedule.pipeline.run_tables``: each action as soon as its inputs
exist; compiled once per shape into one pass, ``walk``) less m (F + B). It no longer
changes with m once m >= 2p (ZB-V's, DualPipeV's steady state), so the walk runs on
min(m, 2p) micro-batches; and it scales with the times (a makespan of fixed tables is
homogeneous in F, I, W), so each (schedule, p, m', B/F, W/F) is walked once, the ratios
binned geometrically by 2% (``_bin``: the bubble within about 1%).
"""

from __future__ import annotations

import math
from functools import lru_cache

from twin.schedule.pipeline import SPLIT_SCHEDULES, V_SCHEDULES, TableDeadlock, table_order
from twin.schedule.tables import stage_table

Program = tuple[tuple[int, tuple[int, int, int, int], tuple[int, ...]], ...]
"""The tables as run_tables runs them: per step (stage, counts of F, B, I, W, its inputs)."""


@lru_cache(maxsize=256)
def _program(schedule: str, p: int, m: int) -> Program:
    """The order ``run_tables`` runs ``schedule``'s tables in (each action, or DualPipe's
    overlapped pair, once its inputs exist): an order that does not depend on the times, so
    it is found once and each walk is one pass over it."""
    v = 2 if schedule in V_SCHEDULES else 1
    orders = [stage_table(schedule, p, m, s, v) for s in range(p)]
    try:
        steps = table_order(orders)
    except TableDeadlock:
        raise ValueError(f"{schedule} tables of p={p}, m={m} deadlock") from None
    made: dict[tuple[str, int, int], int] = {}  # the step that made an output
    out = []
    for s, group, deps in steps:
        counts = tuple(sum(a.phase == ph for a in group) for ph in "FBIW")
        out.append((s, counts, tuple(sorted({made[n] for n in deps}))))
        for a in group:
            made[(a.phase, a.mb, a.chunk)] = len(out) - 1
            if a.phase in ("B", "I"):
                made[("G", a.mb, a.chunk)] = len(out) - 1
    return tuple(out)


def walk(schedule: str, p: int, m: int, f: float, b: float, w: float) -> float:
    """The tables' makespan with forward f, backward b = I + W, W w per micro-batch and
    stage (``twin.schedule.pipeline.ideal_makespan``'s, without overlap pricing)."""
    v = 2 if schedule in V_SCHEDULES else 1
    cost = (f / v, b / v, (b - w) / v, w / v)
    clock = [0.0] * p
    done = []
    for s, (nf, nb, ni, nw), deps in _program(schedule, p, m):
        start = clock[s]
        for d in deps:
            if done[d] > start:
                start = done[d]
        clock[s] = start + nf * cost[0] + nb * cost[1] + ni * cost[2] + nw * cost[3]
        done.append(clock[s])
    return max(clock)


@lru_cache(maxsize=4096)
def _table_bubble(schedule: str, p: int, m: int, b_ratio: float, w_ratio: float) -> float:
    """The bubble of ``schedule``'s tables with F = 1, B = b_ratio, W = w_ratio."""
    return walk(schedule, p, m, 1.0, b_ratio, w_ratio) - m * (1.0 + b_ratio)


BIN = math.log(1.02)


def _bin(x: float) -> float:
    """``x`` > 0 on a geometric grid of 2% steps (0 stays 0)."""
    return math.exp(round(math.log(x) / BIN) * BIN) if x > 0 else 0.0


def pipeline_s(schedule: str, p: int, v: int, m: int, ws: list[float], f: float, b: float,
               w: float) -> float:
    """First forward to last backward (module docstring). ``ws``: W_s of every stage;
    ``f``, ``b``, ``w``: the slowest stage's forward, whole backward (with its exchanges)
    and weight-gradient part of one micro-batch."""
    worst = max(ws)
    if p == 1 or schedule not in SPLIT_SCHEDULES:
        return m * worst + (sum(ws) - worst) / v
    w = min(w, b)
    if schedule == "zb_h1":  # fewer micro-batches than stages: 1F1B's fill and drain, the
        # W of every stage but the first off the critical path
        if m < p:
            return max(m * worst, m * worst + (sum(ws) - worst) / v - (p - 1) * w)
        return m * worst + max(0.0, (p - 1) * (f + b - 2 * w))
    if f <= 0:
        return m * worst
    bubble = _table_bubble(schedule, p, min(m, 2 * p), _bin(b / f), _bin(w / f))
    return m * worst + max(0.0, bubble * f)
