"""Steady-state fast-forward: simulate a pipeline with fewer micro-batches, find the period
its steady state repeats with, and insert the missing periods by arithmetic.

A 1F1B pipeline (and a single stage's forward/backward per micro-batch) runs a warm-up, a
steady state of one forward and one backward per micro-batch, and a cool-down; the
interleaved schedule's steady state repeats every p micro-batches (p * v forward/backward
pairs: the first stage's embedding and the last stage's head come round once per cycle of
chunks; on some pipelines only every 2p). With m micro-batches the step is the warm-up,
(m - m') / d periods more than the run with m' micro-batches, and the same cool-down. So
the job is simulated with m' micro-batches (the warm-up, a period or a few, the cool-down:
``reduced_microbatches``), and the run is checked for a period of d (then 2d)
micro-batches, two ways (``find_cut``):

- a window that repeats (``_window``): every op that starts or runs in the period before
  the cut (and a little more), on every simulated rank, has its counterpart (the same op d
  micro-batches later: its name with the micro-batch moved) start and end exactly T later,
  and no op outside the window has its counterpart across the cut (each op's chain of
  copies passes the cut through the window); the cut lies where no op starts, so rounding
  puts no op on the wrong side of it or of the window's start T before. The run must hold
  2.1 steady periods;
- a state that repeats (``_snapshot``, ``_state_repeats``): at an instant a, which ops have
  started, ended and are in flight is what it is at a + T with every op moved by a
  period, and the history the ops in flight depend on (the flows that shared their links,
  the host's last waits) repeats too; the engine being deterministic, the run from a + T
  does what it did from a, and so would the full job for each period it has more. The
  run must hold a period and that history (1.5 steady periods are simulated first);

and in both the host issues a period's ops in at most T (else it would fall behind the
device over the periods inserted). Then the full step is the reduced run up to the cut, the
window's ops (the period before the cut) repeated n = (m - m') / d times T apart
(micro-batches renamed), and the rest of the reduced run n * T later (``expand``). When no
period is found the reduced run is lengthened (twin/sim/stepsim.py; the shortest is not
tried for programs that do not repeat micro-batch to micro-batch: ``regular``), and past
half the micro-batches the full job is simulated instead.
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

from twin.sim.counterparts import counterparts
from twin.sim.stats import OpTable, Timeline
from twin.spec import Job

SHORT = 1.5
"""Steady periods of d micro-batches the first reduced run holds: enough for a state that
repeats (``_snapshot``), not for a window and its copies (2.1 periods)."""
PERIODS = 4
"""Steady periods of the reduced run tried next (a steady state that had not settled in
the first, or whose history is longer than a period allows), then twice as many; past
that the periods do not repeat (two data-parallel replicas whose links differ each keep
their own period) and the full job is simulated."""
MULTIPLES = 2
"""The steady state may repeat every d or every 2d micro-batches: the interleaved schedule's
steady state alternates between two cycles of chunks on some pipelines (found on p = 8, v = 2
with the head on the last stage); both are looked for, d first (2d where the periods
inserted fit whole)."""
WINDOW = 1.1
"""The steady window checked, in periods: the period before the cut and the ops already
running when it starts (a tenth more leaves room to cut where no op starts)."""
SNAPSHOTS = 4
"""Stretches (the longest) in which a state that repeats is looked for: a steady state is
one long stretch; past a few, the rest are the gaps between warm-up ops."""
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


def reduced_microbatches(job: Job, periods: float) -> int:
    """m': the fewest micro-batches whose run holds ``periods`` steady periods of d
    micro-batches on every stage (the first stage warms up longest), a multiple of d, and
    m - m' a multiple of d (a period of 2d is looked for only where it fits whole)."""
    p = job.parallel
    d = period_microbatches(job) or 1
    if p.pp == 1:  # the steady state's copies need a micro-batch before the last (which
        m_r = max(math.ceil(periods), 3)  # alone syncs gradients): two never hold a period
    elif p.pp_schedule == "interleaved":
        v = p.pp_virtual_stages
        warm = 2 * (p.pp - 1) + (v - 1) * p.pp  # virtual micro-batches (pipeline.interleaved)
        m_r = d * math.ceil((warm + periods * d * v) / (d * v))
    else:
        m_r = p.pp - 1 + math.ceil(periods)
    while (p.num_microbatches - m_r) % d:
        m_r += d
    return m_r


def reduced_job(job: Job, microbatches: int) -> Job:
    """``job`` with ``microbatches`` micro-batches per pipeline (everything else the same)."""
    p = job.parallel
    with warnings.catch_warnings():  # the full job's warnings were given already
        warnings.simplefilter("ignore")
        plan = dataclasses.replace(p, global_batch_size=microbatches * p.micro_batch_size * p.dp)
    return dataclasses.replace(job, parallel=plan)


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


def copies_of(prog, d: int, microbatches: int, memo: dict | None = None):
    """(each op's counterpart d micro-batches later or -1, whether it is another op's
    counterpart) of a program of ``microbatches``; ``memo`` keeps them per program template
    (or ops list) and d."""
    key = (id(prog.ops) if prog.template is None else prog.template, d)
    hit = memo.get(key) if memo is not None else None
    if hit is None or len(hit[0]) != len(prog.ops):
        c = counterparts(prog.ops, d, microbatches, prog.blocks)
        copy = np.zeros(len(c), dtype=bool)
        copy[c[c >= 0]] = True
        hit = c, copy
        if memo is not None:
            memo[key] = hit
    return hit


def regular(programs, d: int, microbatches: int, memo: dict | None = None) -> bool:
    """Whether the programs repeat from one micro-batch to the next but in their first and
    last period: every op of a micro-batch in between is the counterpart of one d earlier,
    and every op before the last period has its counterpart. A short reduced run of
    programs that do not holds no steady state (FSDP under a pipeline keeps its root module
    gathered through the warm-up's forwards and gathers it anew for each forward after a
    backward: in a 1F1B run of pp + 1 micro-batches, for one forward only), and a longer
    run is simulated instead."""
    for prog in programs.values():
        c, copy = copies_of(prog, d, microbatches, memo)
        mb = np.fromiter((op.mb for op in prog.ops), dtype=np.int64, count=len(prog.ops))
        inside = (mb >= 0) & (mb < microbatches - d)
        if (inside & (c < 0)).any() or (inside & (mb >= d) & ~copy).any():
            return False
    return True


def run_lines(sim, d: int, memo: dict | None = None) -> tuple[dict, dict, dict]:
    """Per simulated rank of a finished ``sim``: (starts, ends), each op's counterpart d
    micro-batches later (-1: none) and whether it is another op's counterpart (``memo``:
    as ``copies_of``)."""
    cps, lines, copies = {}, {}, {}
    memo = {} if memo is None else memo
    for r, prog in sim.programs.items():
        cps[r], copies[r] = copies_of(prog, d, sim.job.parallel.num_microbatches, memo)
        lines[r] = (sim.start[r], sim.end[r])
    return lines, cps, copies


def find_cut(sim, d: int, host_of=None, memo: dict | None = None) -> tuple[float, float] | None:
    """(cut, T) of a finished reduced ``sim`` whose steady state repeats (module docstring),
    or None. ``host_of(rank)``: the rank's HostPlan (None: the host never holds ops back);
    ``memo``: as ``copies_of``.
    A period is looked for by a window that repeats (``_window``), else by a state that
    repeats (``_snapshot``: a shorter run suffices)."""
    lines, cps, copies = run_lines(sim, d, memo)
    hosts = {}  # rank -> its plan's (issue times, sync points, waits), or None
    for r in lines:
        h = host_of(r) if host_of else None
        hosts[r] = h and (np.asarray(h.issue_s), np.asarray(h.sync_of), h.waits)
    step = max(float(e.max()) for _, e in lines.values() if len(e))
    tol = TOLERANCE * step
    tried: set[float] = set()
    for r, (s, _) in lines.items():
        c = cps[r]
        valid = np.flatnonzero(c >= 0)
        if not len(valid):
            continue
        mid = valid[np.argsort(s[valid])[len(valid) // 2]]
        gaps = s[c[valid]] - s[valid]  # the commonest gap, then the middle op's
        _, inverse, counts = np.unique(np.round(gaps / tol), return_inverse=True,
                                       return_counts=True)
        common = gaps[np.flatnonzero(inverse == np.argmax(counts))]
        for period in (float(np.median(common)), float(s[c[mid]] - s[mid])):
            if period <= tol or any(abs(period - t) <= 2 * tol for t in tried):
                continue
            tried.add(period)
            bad = _bad_intervals(lines, cps, period, tol)
            found = _window(lines, cps, bad, period, tol, hosts) \
                or _snapshot(lines, cps, copies, bad, period, tol, hosts)
            if found is not None:
                return found
    return None


def _gaps(bad):
    """(lo, hi) of the stretches between the merged intervals ``bad`` ((starts, running
    ends) as ``_bad_intervals`` gives them), longest first; the stretch before the first
    interval starts at -inf, the one after the last ends at inf."""
    bs, be = bad
    lo = np.concatenate([[-np.inf], be])
    hi = np.concatenate([bs, [np.inf]])
    some = np.flatnonzero(hi > lo)  # (most ops overlap the one before)
    order = some[np.argsort(lo[some] - hi[some], kind="stable")]
    return lo[order], hi[order]


def _window(lines, cps, bad, period: float, tol: float, hosts) -> tuple[float, float] | None:
    for lo, hi in zip(*_gaps(bad)):
        if hi - lo < WINDOW * period:
            return None
        end = float(hi)
        if not math.isfinite(end) or not math.isfinite(lo):
            continue  # no bad op before or after: not a steady state between warm-up and cool-down
        lo = max(end - period, float(lo) + (1 + WINDOW) / 2 * period)
        cut = _quiet_instant(lines, lo, end)
        if _crossings_ok(lines, cps, cut, period, tol, hosts):
            return cut, period
    return None


def _snapshot(lines, cps, copies, bad, period: float, tol: float,
              hosts) -> tuple[float, float] | None:
    """(a + T, T) for an instant a at which the run's state is the state T later with every
    op moved by a period (``_state_repeats``), or None. a lies in a stretch where every op
    repeats T later (between ``bad`` intervals), far enough in for the history the state
    holds; the window inserted is [a, a + T), whose copies the run need not hold."""
    tries = 0
    for lo, hi in zip(*_gaps(bad)):
        if not (math.isfinite(lo) and math.isfinite(hi)):
            continue
        if hi - lo <= tol or tries == SNAPSHOTS:  # no room for the history
            return None
        tries += 1
        a = _quiet_instant(lines, (lo + hi) / 2, hi, ends=True)
        if _state_repeats(lines, cps, copies, a, period, float(lo), tol, hosts):
            return a + period, period
    return None


def _state_repeats(lines, cps, copies, a: float, period: float, lo: float, tol: float,
                   hosts) -> bool:
    """Whether the run's state at ``a`` is its state at b = a + T, every op moved by a period
    (its counterpart): then from b the run does again what it did from a, and so would
    the full job (whose program holds more periods) for as many periods as it has more.
    The state: which ops have started and ended (an op's counterpart has started by b iff
    it had by a, and likewise ended; an op of the first period, nobody's counterpart, has
    ended by b; an op of no period neither starts nor ends between a and b), the ops in
    flight (their counterparts start and end T later), and the history their remaining
    work depends on: a transfer's rate depends on every flow that shared its links since it
    started, and an op the host issues after a waited for the ops of its sync point. So
    every op that runs or ends from the earliest of those instants up to a must repeat T
    later: the stretch from ``lo`` (where every op repeats) must hold it. The host: its
    plan must issue a period's ops in at most T (the history's ops), and an op issued in
    [a, b) at the plan's own time (no slack) must have its counterpart issued exactly T
    later. The reduced run is the full job's up to b: had its cool-down begun before b
    (ops of the last periods run closer together, none of the next period between them),
    the ops started by b would not be the copies of those started by a."""
    b = a + period
    since = a
    for r, (s, e) in lines.items():
        c = cps[r]
        ok = c >= 0
        cc = c[ok]
        if ((s[ok] < a) != (s[cc] < b)).any() or ((e[ok] <= a) != (e[cc] <= b)).any():
            return False
        lone = ~copies[r]  # the first period's ops (their counterparts later) must have
        if (lone & ok & (e > b)).any():  # ended by b, an op of no period never moves in [a, b]
            return False
        if (lone & ~ok & (((s >= a) & (s < b)) | ((e > a) & (e <= b)))).any():
            return False
        flying = (s < a) & (e > a)
        if flying.any():
            since = min(since, float(s[flying].min()))
        host = hosts.get(r) if hosts else None
        if host is not None:
            issue, sync_of, waits = host
            issued = np.flatnonzero((s >= a) & (s < b))
            sync = sync_of[issued]
            for p in np.unique(sync[sync >= 0]).tolist():
                since = min(since, max(float(e[w]) for w in waits[p]))
            tight = issued[s[issued] - issue[issued] <= tol]
            if len(tight) and ((c[tight] < 0).any() or (np.abs(
                    issue[c[tight]] - issue[tight] - period) > tol).any()):
                return False
    if since < lo:
        return False
    for r, (s, e) in lines.items():  # the host keeps up over the history
        host = hosts.get(r) if hosts else None
        if host is not None:
            c, issue = cps[r], host[0]
            hist = np.flatnonzero((c >= 0) & (e > since) & (s < a))
            if (issue[c[hist]] - issue[hist] > period + tol).any():
                return False
    return True


def _quiet_instant(lines, lo: float, hi: float, ends: bool = False) -> float:
    """The middle of the longest stretch of [lo, hi] in which no op starts (``ends``: nor
    ends): a cut there (and T before it, by the period) is far from every start, so rounding
    puts no op on the wrong side of it."""
    times = [t[(t >= lo) & (t <= hi)] for s, e in lines.values() for t in ((s, e) if ends else (s,))]
    starts = np.unique(np.concatenate(times + [np.array([lo, hi])]))
    k = int(np.argmax(np.diff(starts)))
    return float(starts[k] + starts[k + 1]) / 2


def _crossings_ok(lines, cps, cut: float, period: float, tol: float, hosts) -> bool:
    """Every chain of copies crosses the cut through the window, T apart; the host keeps up."""
    for r, (s, _) in lines.items():
        c = cps[r]
        ok = c >= 0
        cc = np.where(ok, c, 0)
        cross = ok & (s < cut) & (s[cc] >= cut)
        if (cross & ((s < cut - period - tol) | (np.abs(s[cc] - s - period) > tol))).any():
            return False
        host = hosts.get(r) if hosts else None
        if host is not None:
            window = np.flatnonzero(ok & (s >= cut - period) & (s < cut))
            issue = host[0]
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
