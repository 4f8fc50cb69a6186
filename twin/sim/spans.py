"""The trace a simulation records, sized to what it is for.

``full``: every simulated rank's spans at every step (the library's default: validate joins
them with the executor's). ``auto``: what the report draws by default: whole steps of the
first simulated rank of each pipeline stage, then the other simulated ranks in order, while
they fit in ``TRACE_SPANS`` timed spans (the report's ``max_spans``; at least one rank).
``none``: no spans (the summary is computed from the engine's arrays either way:
twin/sim/stats.py). Spans of a fast-forwarded step are its expansion, micro-batches renamed
(twin/sim/fastforward.py), so they read as the full run's.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from twin.schedule.names import joined, mb_tokens
from twin.sim.stats import Timeline
from twin.trace import Span
from twin.vocab import COLLECTIVE_KINDS, P2P_KINDS

_CALLS = frozenset(COLLECTIVE_KINDS) | frozenset(P2P_KINDS)

TRACE_LEVELS = ("auto", "full", "none")
TRACE_SPANS = 400_000
"""Timed spans the ``auto`` trace holds at most: the report's default ``max_spans``
(twin.report.timeline.MAX_SPANS), the most its timeline draws."""


def recorded_ranks(level: str, stage_of: dict[int, int], timed: dict[int, int],
                   steps: int) -> list[int]:
    """The simulated ranks whose spans a ``level`` trace holds, ascending. ``stage_of``:
    rank -> its pipeline stage; ``timed``: rank -> timed ops in one step."""
    if level == "none":
        return []
    ranks = sorted(stage_of)
    if level == "full":
        return ranks
    if level != "auto":
        raise ValueError(f"trace={level!r} is not one of {'|'.join(TRACE_LEVELS)}")
    first: dict[int, int] = {}
    for r in ranks:
        first.setdefault(stage_of[r], r)
    order = sorted(first.values()) + [r for r in ranks if r not in set(first.values())]
    out, total = [], 0
    for r in order:
        total += timed[r] * steps
        if out and total > TRACE_SPANS:
            break
        out.append(r)
    return sorted(out)


def rank_spans(rank: int, ops, line: Timeline, step: int, offset_s: float,
               moved: np.ndarray | None = None) -> Iterator[Span]:
    """The spans of one rank's step (times in us from the run's start); ``moved``: per entry,
    the micro-batches a fast-forwarded op is moved by (its name and tag renamed)."""
    start = ((offset_s + line.start_s) * 1e6).tolist()
    end = ((offset_s + line.end_s) * 1e6).tolist()
    shift = moved.tolist() if moved is not None else None
    parts: dict[int, tuple] = {}  # op -> its name and tag split around their micro-batches
    fixed: dict[int, tuple] = {}  # op -> its span's fields as ``Span.of`` sets them
    for k, i in enumerate(line.idx.tolist()):
        f = fixed.get(i)
        if f is None:
            op = ops[i]
            comm = op.kind in _CALLS  # Span.of: the group of a collective or send/recv
            f = fixed[i] = (op.name, op.kind, op.stream, op.phase, op.layer, op.mb,
                            op.group_name if comm else "", op.bytes, op.flops, op.category,
                            op.peer, op.tag)
        dmb = shift[k] if shift is not None and f[5] >= 0 else 0
        if not dmb:
            yield Span(rank, step, f[0], f[1], f[2], start[k], end[k], f[3], f[4], f[5], f[6],
                       f[7], f[8], f[9], f[10], f[11])
            continue
        split = parts.get(i)
        if split is None:
            split = parts[i] = (mb_tokens(f[0]), mb_tokens(f[11]) if f[11] else None)
        tag = joined(*split[1], dmb) if split[1] else f[11]
        yield Span(rank, step, joined(*split[0], dmb), f[1], f[2], start[k], end[k], f[3], f[4],
                   f[5] + dmb, f[6], f[7], f[8], f[9], f[10], tag)
