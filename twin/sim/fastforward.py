"""Steady-state fast-forward: simulate a pipeline with fewer micro-batches, find the period
its steady state repeats with, and insert the missing periods by arithmetic.

A 1F1B pipeline (and a single stage's forward/backward per micro-batch) runs a warm-up, a
steady state of one forward and one backward per micro-batch, and a cool-down; the
interleaved schedule's steady state repeats every p micro-batches (p * v forward/backward
pairs: the first stage's embedding and the last stage's head come round once per cycle of
chunks; on some pipelines only every 2p). With m micro-batches the step is the warm-up,
(m - m') / d periods more than the run with m' micro-batches, and the same cool-down. So the
job is simulated with m' micro-batches (the warm-up, a few periods, the cool-down:
``reduced_microbatches``), and the run is checked for a period of d (then 2d) micro-batches:

- every op that starts or runs in the period before the cut (and a little more), on every
  simulated rank, has its counterpart (the same op d micro-batches later: its name with the
  micro-batch moved) start and end exactly T later: the state repeats (the same ops in
  flight, the same link loads, so the same times after); the cut lies where no op starts,
  so rounding puts no op on the wrong side of it or of the window's start T before;
- no op outside the window has its counterpart across the cut (each op's chain of copies
  passes the cut through the window);
- the host issues a period's ops in at most T (else it would fall behind the device over
  the periods inserted).

Then the full step is the reduced run up to the cut, the window's ops repeated n = (m - m')
/ d times T apart (micro-batches renamed), and the rest of the reduced run n * T later
(``expand``). When the check fails the reduced run is lengthened once
(twin/sim/stepsim.py), and past half the micro-batches the full job is simulated instead.
Exact when the check passes: nothing is approximated, whole periods are added. Off with
jitter (no two periods are alike) and with what-ifs; not tried for GPipe (two steady
phases, forwards then backwards) or a single micro-batch per step.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import NamedTuple

import numpy as np

from twin.schedule.names import moved
from twin.sim.stats import OpTable, Timeline
from twin.spec import Job

PERIODS = 4
"""Steady periods of d micro-batches the first reduced run holds."""
MULTIPLES = 2
"""The steady state may repeat every d or every 2d micro-batches: the interleaved schedule's
steady state alternates between two cycles of chunks on some pipelines (found on p = 8, v = 2
with the head on the last stage); both are looked for, d first."""
WINDOW = 1.1
"""The steady window checked, in periods: the period before the cut and the ops already
running when it starts (a tenth more leaves room to cut where no op starts)."""
TOLERANCE = 1e-9
"""A counterpart repeats when its start and end differ from T by less than this fraction of
the reduced run's step."""


def period_microbatches(job: Job) -> int | None:
    """d: micro-batches per period of the steady state (None: no single steady state)."""
    p = job.parallel
    if p.pp > 1 and (p.pp_schedule in ("gpipe", "zb_h1", "zb_v", "dualpipev")
                     or p.pp_schedule_csv is not None):
        return None  # simulated whole (a CSV table cannot be cut shorter)
    return p.pp if p.pp_schedule == "interleaved" and p.pp > 1 else 1


def reduced_microbatches(job: Job, periods: int) -> int:
    """m': the fewest micro-batches whose run holds ``periods`` steady periods of d
    micro-batches on every stage (the first stage warms up longest), a multiple of d, and
    m - m' a multiple of ``MULTIPLES`` periods (so that any period found fits whole)."""
    p = job.parallel
    d = period_microbatches(job) or 1
    if p.pp == 1:  # the window (1.1 periods) and its copies a period later reach into three
        m_r = max(periods, 3)  # micro-batches: two never hold a period
    elif p.pp_schedule == "interleaved":
        v = p.pp_virtual_stages
        warm = 2 * (p.pp - 1) + (v - 1) * p.pp  # virtual micro-batches (pipeline.interleaved)
        m_r = d * math.ceil((warm + periods * d * v) / (d * v))
    else:
        m_r = p.pp - 1 + periods
    while (p.num_microbatches - m_r) % (MULTIPLES * d):
        m_r += d
    return m_r


def reduced_job(job: Job, microbatches: int) -> Job:
    """``job`` with ``microbatches`` micro-batches per pipeline (everything else the same)."""
    p = job.parallel
    with warnings.catch_warnings():  # the full job's warnings were given already
        warnings.simplefilter("ignore")
        plan = dataclasses.replace(p, global_batch_size=microbatches * p.micro_batch_size * p.dp)
    return dataclasses.replace(job, parallel=plan)


def counterparts(ops, d: int, microbatches: int | None = None, blocks=None) -> np.ndarray:
    """Per op, the index of the same op d micro-batches later (-1: none, or no micro-batch).
    ``microbatches``: the program's micro-batches (an op of micro-batch m - d or later has
    no counterpart; None: its names are looked up). ``blocks``: the program's stamped bodies
    and actions (Program.blocks): one whose copy d micro-batches later was stamped too has
    its ops' counterparts there, op for op, without reading a name (an action's copy may be
    stamped from another template that names its ops alike: ActionTemplate.names); the
    other ops' are found by name, first among the ops outside every block, then in the
    blocks of the micro-batches still looked for."""
    last = (microbatches if microbatches is not None else 1 << 62) - d
    out = np.full(len(ops), -1, dtype=np.int64)
    todo = range(len(ops))  # the ops looked up by name
    outside = None  # the ops in no block (None: no blocks)
    if blocks:
        first = {(getattr(t, "names", t), *key): base for t, *key, base in blocks}
        bases, others, sizes, stray = [], [], [], []  # each body with a copy: its ops, the copy's
        for t, phase, layer, chunk, mb, base in blocks:
            if 0 <= mb < last:
                other = first.get((getattr(t, "names", t), phase, layer, chunk, mb + d))
                if other is None:  # its copy was built by the generic code
                    stray.extend(range(base, base + t.size))
                else:
                    bases.append(base)
                    others.append(other)
                    sizes.append(t.size)
        n = np.asarray(sizes, dtype=np.int64)
        within = np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)  # each op's place in its body
        at = np.repeat(np.asarray(bases, dtype=np.int64), n) + within
        out[at] = np.repeat(np.asarray(others, dtype=np.int64), n) + within
        outside = np.ones(len(ops), dtype=bool)
        for _t, *_, base in blocks:
            outside[base:base + _t.size] = False
        outside = np.flatnonzero(outside).tolist()
        todo = sorted(outside + stray)
    wanted: dict[str, list[int]] = {}  # counterpart's name -> the ops it is the copy of
    phase, mb = None, -1  # the (phase, mb) of the op before: the next ops mostly share it
    for i in todo:
        op = ops[i]
        if 0 <= op.mb < last:
            if op.mb != mb or op.phase != phase:
                phase, mb = op.phase, op.mb
                head = f"{phase}/mb{mb}/"  # the builders' prefix (ProgramBuilder.emit)
                later, n, plain = f"{phase}/mb{mb + d}/", len(head), "mb" not in phase
            name = op.name
            if plain and name.startswith(head):  # its mb token, then the rest's (if any)
                new = later + moved(name[n:], d)
            else:
                new = moved(name, d)
            wanted.setdefault(new, []).append(i)
    if wanted:
        _look_up(ops, out, wanted, range(len(ops)) if outside is None else outside)
        if outside is not None:  # the rest in the blocks of their micro-batches
            mbs = {ops[hit[0]].mb + d for hit in wanted.values() if out[hit[0]] < 0}
            if mbs:
                _look_up(ops, out, wanted, [i for t, _p, _l, _c, mb, base in blocks if mb in mbs
                                            for i in range(base, base + t.size)])
    return out


def _look_up(ops, out: np.ndarray, wanted: dict[str, list[int]], indices) -> None:
    """``out[i] = j`` for each op ``j`` of ``indices`` whose name is wanted by ``i``."""
    get = wanted.get
    for j in indices:
        hit = get(ops[j].name)
        if hit is not None:
            out[hit] = j


class Cut(NamedTuple):
    """Where the reduced run is cut and how many periods go in (see the module docstring)."""

    cut_s: float
    period_s: float
    periods: int
    """n: periods inserted."""
    period_mb: int
    """d: micro-batches per period."""


def _bad_intervals(lines, cps, period: float, tol: float):
    """[start, end] of every op (all ranks) that does not repeat T later."""
    starts, ends = [], []
    for r, (s, e) in lines.items():
        c = cps[r]
        ok = c >= 0
        cc = np.where(ok, c, 0)
        ok &= np.abs(s[cc] - s - period) <= tol
        ok &= np.abs(e[cc] - e - period) <= tol
        starts.append(s[~ok])
        ends.append(e[~ok])
    s, e = np.concatenate(starts), np.concatenate(ends)
    order = np.argsort(s, kind="stable")
    return s[order], np.maximum.accumulate(e[order]) if len(e) else e


def find_cut(sim, d: int, host_of=None) -> tuple[float, float] | None:
    """(cut, T) of a finished reduced ``sim`` whose steady state repeats (module docstring),
    or None. ``host_of(rank)``: the rank's HostPlan (None: the host never holds ops back)."""
    cps, lines = {}, {}
    memo: dict[int, np.ndarray] = {}
    for r, prog in sim.programs.items():
        key = id(prog.ops) if prog.template is None else prog.template
        if key not in memo:
            memo[key] = counterparts(prog.ops, d, sim.job.parallel.num_microbatches, prog.blocks)
        cps[r] = memo[key]
        lines[r] = (sim.start[r], sim.end[r])
    step = max(float(e.max()) for _, e in lines.values() if len(e))
    tol = TOLERANCE * step
    tried: set[float] = set()
    for r, (s, _) in lines.items():
        c = cps[r]
        valid = np.flatnonzero(c >= 0)
        if not len(valid):
            continue
        mid = valid[np.argsort(s[valid])[len(valid) // 2]]
        period = float(s[c[mid]] - s[mid])
        if period <= tol or any(abs(period - t) <= tol for t in tried):
            continue
        tried.add(period)
        found = _window(lines, cps, period, tol, host_of)
        if found is not None:
            return found
    return None


def _window(lines, cps, period: float, tol: float, host_of) -> tuple[float, float] | None:
    bs, be = _bad_intervals(lines, cps, period, tol)
    # gaps between the merged bad intervals: from each one's end to the next one's start
    gap_lo = np.concatenate([[-np.inf], be])
    gap_hi = np.concatenate([bs, [np.inf]])
    length = gap_hi - gap_lo
    for k in np.argsort(-length):
        if length[k] < WINDOW * period:
            return None
        end = float(gap_hi[k])
        if not math.isfinite(end) or not math.isfinite(gap_lo[k]):
            continue  # no bad op before or after: not a steady state between warm-up and cool-down
        lo = max(end - period, float(gap_lo[k]) + (1 + WINDOW) / 2 * period)
        cut = _quiet_instant(lines, lo, end)
        if _crossings_ok(lines, cps, cut, period, tol, host_of):
            return cut, period
    return None


def _quiet_instant(lines, lo: float, hi: float) -> float:
    """The middle of the longest stretch of [lo, hi] in which no op starts: a cut there (and
    T before it, by the period) is far from every start, so rounding puts no op on the
    wrong side of it."""
    starts = np.unique(np.concatenate([s[(s >= lo) & (s <= hi)] for s, _ in lines.values()]
                                      + [np.array([lo, hi])]))
    k = int(np.argmax(np.diff(starts)))
    return float(starts[k] + starts[k + 1]) / 2


def _crossings_ok(lines, cps, cut: float, period: float, tol: float, host_of) -> bool:
    """Every chain of copies crosses the cut through the window, T apart; the host keeps up."""
    for r, (s, _) in lines.items():
        c = cps[r]
        ok = c >= 0
        cc = np.where(ok, c, 0)
        cross = ok & (s < cut) & (s[cc] >= cut)
        if (cross & ((s < cut - period - tol) | (np.abs(s[cc] - s - period) > tol))).any():
            return False
        host = host_of(r) if host_of else None
        if host is not None:
            window = np.flatnonzero(ok & (s >= cut - period) & (s < cut))
            issue = np.asarray(host.issue_s)
            if (issue[c[window]] - issue[window] > period + tol).any():
                return False
    return True


def expand(table: OpTable, start: np.ndarray, end: np.ndarray, cut: Cut) -> tuple[Timeline, np.ndarray]:
    """One rank's full step from its reduced run: (Timeline, micro-batches each entry's op
    is moved by). Ops before the cut as they ran; the window's ops repeated n times, T apart;
    the rest n * T later."""
    t, period, n, d = cut
    before = np.flatnonzero(start < t)
    window = np.flatnonzero((start >= t - period) & (start < t))
    after = np.flatnonzero(start >= t)
    shifts = np.arange(1, n + 1, dtype=float) * period
    idx = np.concatenate([before, np.tile(window, n), after])
    s = np.concatenate([start[before], (start[window][None, :] + shifts[:, None]).ravel(),
                        start[after] + n * period])
    e = np.concatenate([end[before], (end[window][None, :] + shifts[:, None]).ravel(),
                        end[after] + n * period])
    moved = np.concatenate([np.zeros(len(before), np.int64),
                            np.repeat(np.arange(1, n + 1) * d, len(window)),
                            np.full(len(after), n * d, np.int64)])
    return Timeline(table, idx, s, e), moved
