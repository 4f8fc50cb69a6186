"""A simulated step's figures from the engine's per-rank arrays, without building spans.

The same figures ``twin.metrics.step_stats`` computes from a trace's spans (step time;
per rank compute, idle, exposed communication per group, the pipeline bubble, peak tensor
memory), computed per rank with numpy on the op indices and start/end times a rank ran
(``Timeline``: a simulation's arrays, or a fast-forwarded expansion of them), so the summary
covers every simulated rank whatever the trace records. Interval algebra as in metrics:
the union of intervals is measured after sorting by start (each adds what reaches past the
running maximum of the ends before it); communication exposed beside compute is
|comm U compute| - |compute|; the bubble is the pipeline window less |compute U comm|.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from twin.sim.codes import Codes, codes_of
from twin.vocab import COLLECTIVE_KINDS, COMPUTE_KINDS, MEMORY_KINDS, P2P_KINDS, PIPELINE_PHASES

_CALLS = frozenset(COLLECTIVE_KINDS) | frozenset(P2P_KINDS)


class OpTable(NamedTuple):
    """What the figures need of each op of one program, as arrays (op index -> value)."""

    compute: np.ndarray
    """Compute ops (busy time)."""
    timed: np.ndarray
    """Ops that take time: everything but memory ops."""
    pipe: np.ndarray
    """Compute ops of the pipeline's phases (fwd, bwd, recompute): the bubble's window."""
    group: np.ndarray
    """Non-compute timed ops: index into ``groups`` (their group, else their kind); -1 others."""
    groups: tuple[str, ...]
    bubble_comm: np.ndarray
    """Communication that counts as work inside the bubble's window (not pp, pipeline phases)."""
    memory: np.ndarray
    """Alloc and free ops."""
    is_alloc: np.ndarray
    mem_bytes: np.ndarray
    """Signed bytes of memory ops: + alloc, - free, 0 for the rest."""


def op_table(ops, codes: Codes | None = None) -> OpTable:
    """The table of a program's ops (see OpTable); the span fields as ``Span.of`` sets them.
    ``codes``: the ops' signatures (default: made here)."""
    codes = codes_of(ops) if codes is None else codes
    reps, column = codes.reps, codes.column
    compute = column([op.kind in COMPUTE_KINDS for op in reps], bool)
    memory = column([op.kind in MEMORY_KINDS for op in reps], bool)
    is_alloc = column([op.kind == "alloc" for op in reps], bool)
    pipe_phase = column([op.phase in PIPELINE_PHASES for op in reps], bool)
    # the groups (calls by their group's name, other ops by kind) numbered as they first come
    role = [None if op.kind in COMPUTE_KINDS or op.kind in MEMORY_KINDS
            else (op.group_name if op.kind in _CALLS else "") or op.kind for op in reps]
    names: dict[str, int] = {}
    for c in codes.in_order():
        if role[c] is not None:
            names.setdefault(role[c], len(names))
    group = column([-1 if r is None else names[r] for r in role], np.int64)
    pp = column([r is not None and op.kind in _CALLS and op.group_name == "pp"
                 for op, r in zip(reps, role)], bool)
    nbytes = column([float(op.bytes) if op.kind in MEMORY_KINDS else 0.0 for op in reps], float)
    mem_bytes = np.where(is_alloc, nbytes, -nbytes)
    timed = ~memory
    return OpTable(compute, timed, compute & pipe_phase, group, tuple(names),
                   timed & ~compute & ~pp & pipe_phase, memory, is_alloc, mem_bytes)


class Timeline(NamedTuple):
    """One rank's step: which ops ran (``idx``, with repeats when fast-forwarded) and when."""

    table: OpTable
    idx: np.ndarray
    start_s: np.ndarray
    end_s: np.ndarray


def union_length(a: np.ndarray, b: np.ndarray) -> float:
    """Total length covered by the intervals [a_i, b_i] (twin.metrics.union_length)."""
    if not len(a):
        return 0.0
    order = np.lexsort((b, a))
    a, b = a[order], b[order]
    before = np.empty_like(b)
    before[0] = -np.inf
    np.maximum.accumulate(b[:-1], out=before[1:])
    return float(np.maximum(b - np.maximum(a, before), 0.0).sum())


def peak_memory(t: np.ndarray, is_alloc: np.ndarray, nbytes: np.ndarray) -> float:
    """Peak live bytes of one rank (frees before allocs at one instant; metrics.peak_memory)."""
    if not len(t):
        return 0.0
    order = np.lexsort((np.abs(nbytes), is_alloc, t))
    return max(0.0, float(np.cumsum(nbytes[order]).max()))


def step_figures(lines: dict[int, Timeline], offset_s: float = 0.0) -> dict:
    """``twin.metrics.step_stats`` of one step from its ranks' timelines (times in us from
    the run's start: ``offset_s`` + the simulated time, as the trace's spans hold them)."""
    us = {}
    for r, ln in lines.items():
        us[r] = ((offset_s + ln.start_s) * 1e6, (offset_s + ln.end_s) * 1e6)
    lo, hi, w0, w1 = np.inf, -np.inf, np.inf, -np.inf
    for r, ln in lines.items():
        a, b = us[r]
        tab = ln.table
        timed = tab.timed[ln.idx]
        if timed.any():
            lo, hi = min(lo, float(a[timed].min())), max(hi, float(b[timed].max()))
        pipe = tab.pipe[ln.idx]
        if pipe.any():
            w0, w1 = min(w0, float(a[pipe].min())), max(w1, float(b[pipe].max()))
    if lo == np.inf:
        raise ValueError("the step has no timed ops")
    if w0 == np.inf:
        w0, w1 = lo, hi
    step_us = hi - lo
    compute, idle, bubble, mem = {}, {}, {}, {}
    exposed: dict[str, dict[int, float]] = {}
    for r in sorted(lines):
        ln = lines[r]
        tab, idx = ln.table, ln.idx
        a, b = us[r]
        busy = tab.compute[idx]
        ba, bb = a[busy], b[busy]
        compute[r] = union_length(ba, bb)
        idle[r] = step_us - compute[r]
        group = tab.group[idx]
        for g in np.unique(group[group >= 0]):
            sel = group == g
            both = union_length(np.concatenate([a[sel], ba]), np.concatenate([b[sel], bb]))
            exposed.setdefault(tab.groups[g], {})[r] = max(0.0, both - compute[r])
        inside = busy & (b > w0) & (a < w1)
        coll = tab.bubble_comm[idx] & (b > w0) & (a < w1)
        work = inside | coll
        covered = union_length(np.clip(a[work], w0, w1), np.clip(b[work], w0, w1))
        bubble[r] = max(0.0, (w1 - w0) - covered)
        memory = tab.memory[idx]
        mi = idx[memory]
        mem[r] = peak_memory(a[memory], tab.is_alloc[mi], tab.mem_bytes[mi])
    return {"step_us": step_us, "compute_us": compute, "idle_us": idle,
            "exposed_us": dict(sorted(exposed.items())), "bubble_us": bubble,
            "peak_memory_bytes": mem}
