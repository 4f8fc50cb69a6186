"""Each op's counterpart d micro-batches later: the same op, its name's micro-batches moved
(twin/schedule/names.py), which the fast-forward's checks compare it with
(twin/sim/fastforward.py)."""

from __future__ import annotations

import numpy as np

from twin.schedule.names import moved


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
