"""Per-op signature codes: the fields the simulator's per-op passes read, interned once per
program, so that those passes work per distinct signature and by array lookups, not per op.

A signature is what the passes over a program's ops read of an op: its kind, stream,
phase, paradigm, dtype, shape, FLOPs, bytes, group name and group size (the compute time
and the host's time are functions of these, as their memo keys say, and so are the
streams, the memory ops, the host's sync points and the op table's columns). A stage of a
long pipeline has tens of thousands of ops and a few dozen signatures. The stamped bodies
(Program.blocks) are coded from their first copy and tiled by numpy: a body's ops take
their fields from its template (twin/schedule/stamp.py), so every copy has the same
signatures in the same places; the other ops are coded one by one.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from twin.schedule.ir import Op, Program


class Codes(NamedTuple):
    """A program's ops by signature."""

    code: np.ndarray
    """Per op: its signature's number."""
    reps: list[Op]
    """Per signature: the first op that has it (it stands for every op of its signature)."""
    first: np.ndarray
    """Per signature: the index of that op."""

    def column(self, values, dtype=None) -> np.ndarray:
        """Per op, the value of its signature (``values``: one per signature)."""
        return np.asarray(values, dtype=dtype)[self.code]

    def where(self, pred) -> list[int]:
        """The indices of the ops whose signature's op satisfies ``pred``, in program order."""
        return np.flatnonzero(self.column([pred(op) for op in self.reps], bool)).tolist()

    def in_order(self) -> list[int]:
        """The signatures in the order their first op comes in the program."""
        return np.argsort(self.first, kind="stable").tolist()

    def stream_indices(self, skip: str = "mem") -> dict[str, list[int]]:
        """Stream -> indices of its ops in program order, the streams in the order their
        first op comes (``skip``'s ops left out)."""
        return {s: idx.tolist() for s, idx in self.stream_arrays(skip).items()}

    def stream_arrays(self, skip: str = "mem") -> dict[str, np.ndarray]:
        """``stream_indices`` as arrays."""
        names = [op.stream for op in self.reps]
        number = {s: k for k, s in enumerate(dict.fromkeys(names))}
        per_op = self.column([number[s] for s in names], np.int64)
        return {s: np.flatnonzero(per_op == number[s])
                for s in dict.fromkeys(names[c] for c in self.in_order()) if s != skip}


def signature(op: Op) -> tuple:
    """What the per-op passes read of ``op`` (see the module docstring)."""
    return (op.kind, op.stream, op.phase, op.paradigm, op.dtype, op.shape, op.flops, op.bytes,
            op.group_name, len(op.group))


def codes_of(ops: list[Op], blocks=None) -> Codes:
    """The Codes of ``ops``; ``blocks``: their stamped bodies (Program.blocks), coded from
    their first copy."""
    code = np.full(len(ops), -1, dtype=np.int64)
    number: dict[tuple, int] = {}
    bodies: dict[tuple, list[int]] = {}
    for t, phase, _layer, _chunk, _mb, base in blocks or ():
        bodies.setdefault((t, phase), []).append(base)
    for (t, _phase), bases in bodies.items():
        first = bases[0]
        row = [number.setdefault(signature(op), len(number)) for op in ops[first:first + t.size]]
        at = (np.asarray(bases, dtype=np.int64)[:, None] + np.arange(t.size)).ravel()
        code[at] = np.tile(np.asarray(row, dtype=np.int64), len(bases))
    rest = np.flatnonzero(code < 0).tolist()  # the ops coded one by one
    if rest:
        code[rest] = [number.setdefault(signature(ops[i]), len(number)) for i in rest]
    _, first = np.unique(code, return_index=True)  # signatures are numbered 0..n-1
    return Codes(code, [ops[i] for i in first.tolist()], first)


def op_codes(prog: Program) -> Codes:
    """``prog``'s Codes, made on first use and kept on the program (``Program.codes``)."""
    held = prog.codes
    if held is None or len(held.code) != len(prog.ops):
        held = prog.codes = codes_of(prog.ops, prog.blocks)
    return held
