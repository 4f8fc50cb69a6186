"""What each process of a rank walks: the program's streams, the base compute times, the
host's plan, and which dependencies cross processes (those get events).

One process per FIFO stream and one per send/recv (twin/sim/engine.py); a stream of private
calls (twin/sim/private.py) is walked by the compute stream's process, so its dependencies on
the compute stream, and the compute stream's on it, are timed by arithmetic.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from twin.schedule.ir import Op
from twin.sim.codes import Codes, codes_of, op_codes
from twin.sim.private import COMPUTE
from twin.sim.records import Structure
from twin.vocab import COMPUTE_KINDS


class Walk(NamedTuple):
    """What a rank's processes walk when some streams are inlined into the compute one."""

    walks: dict[str, list[int]]
    """Process (a stream) -> its ops in program order (inlined streams' ops included)."""
    external: set[int]
    """Ops another process (or the host's sync) waits for: they get events."""
    ext_deps: list[tuple[int, ...]]
    """Per op: its dependencies another process times (waited for by event)."""
    cross: list[tuple[int, ...]]
    """Per op: its dependencies on another stream of its own walk (timed by arithmetic)."""


def structure(ops: list[Op], compute_time, host, codes: Codes | None = None) -> Structure:
    """The Structure of a program: its streams, base compute times (``compute_time(op)``,
    once per signature) and the host's plan. ``codes``: its ops' (default: made here)."""
    codes = codes_of(ops) if codes is None else codes
    compute = [op.kind in COMPUTE_KINDS for op in codes.reps]
    base = [compute_time(op) if c and op.stream != "mem" else 0.0
            for op, c in zip(codes.reps, compute)]
    memory = codes.column([op.stream == "mem" for op in codes.reps], bool)
    return Structure(codes.stream_indices(), codes.column(base, float).tolist(), host,
                     codes.column(compute, bool).tolist(), np.flatnonzero(memory).tolist())


def build_walk(ops: list[Op], st: Structure, inlined: tuple[str, ...] = (),
               codes: Codes | None = None) -> Walk:
    """The Walk of a program whose ``inlined`` streams the compute stream's process times.
    ``codes``: its ops' signatures (default: made here; an op's stream is part of it)."""
    streams = st.streams
    codes = codes_of(ops) if codes is None else codes
    names = [op.stream for op in codes.reps]
    stream_of = np.asarray(names, dtype=object)[codes.code].tolist() if len(ops) else []
    if inlined:
        walks = {s: idx for s, idx in streams.items() if s not in inlined}
        walks[COMPUTE] = sorted(sum((streams[s] for s in inlined), list(streams[COMPUTE])))
        proc = [COMPUTE if x in inlined else x for x in names]
        lab = np.asarray(proc, dtype=object)[codes.code].tolist()  # the process an op is
    else:  # walked by (p2p: each its own)
        walks = streams
        lab = stream_of
    n = len(ops)
    external: set[int] = set()
    ext_deps: list[tuple[int, ...]] = [()] * n
    cross: list[tuple[int, ...]] = [()] * n
    for i, op in enumerate(ops):  # one pass: most ops wait for one op of their own walk
        deps = op.deps
        if not deps:
            continue
        li = lab[i]
        if li == "p2p":  # its own process: it waits for every dependency by event
            external.update(deps)
            ext_deps[i] = deps
        elif li != "mem":  # (memory ops are timed after the run)
            if len(deps) == 1:
                d = deps[0]
                if lab[d] != li:
                    external.add(d)
                    ext_deps[i] = deps
                elif inlined and stream_of[d] != stream_of[i]:
                    cross[i] = deps
                continue
            # a dependency on the op's own process is done by then (FIFO) or timed (cross)
            other = tuple(d for d in deps if lab[d] != li)
            if other:
                external.update(other)
                ext_deps[i] = other
            if inlined:
                cross[i] = tuple(d for d in deps if lab[d] == li and stream_of[d] != stream_of[i])
    if st.host is not None:
        for waited in st.host.waits.values():
            external.update(waited)  # the host waits for them: they need events
    return Walk(walks, external, ext_deps, cross)


def walk_of(inliner, cache: dict, rank: int, prog, st: Structure) -> tuple[Walk, dict | None]:
    """A rank's Walk (cached per program template and inlined streams) and the private calls
    its compute walk times (twin.sim.private.Inliner.timed; None: each stream walks itself)."""
    inlined = inliner.streams(rank, prog.ops, st.streams, st.host)
    key = (prog.template if prog.template is not None else -1 - rank, inlined)
    walk = cache.get(key)
    if walk is None:
        walk = cache[key] = build_walk(prog.ops, st, inlined, op_codes(prog))
    return walk, (inliner.timed(prog.ops, st.streams, inlined) if inlined else None)


def memory_times(ops: list[Op], st: Structure, start, end) -> None:
    """Memory ops take no time: each happens when its last dependency ends."""
    for i in st.memory:
        deps = ops[i].deps
        t = end[deps[0]] if len(deps) == 1 else max((end[d] for d in deps), default=0.0)
        start[i] = end[i] = t
