"""Record and stamp whole actions: a pipeline action's compute (one chunk's forward or
backward on one micro-batch, its units with every pass's hooks) built once per kind, then
copied for the later micro-batches of that kind.

Layer bodies are stamped already (stamp.py); what the passes emit around them (kept
activations' allocs and frees, the recomputed forward) and the builder's own walk (units,
contexts, hooks) cost as much again on a long pipeline. An action is offered when its
units are all layers (the embedding and head keep per-micro-batch state: the
cross-entropy's all-reduce that the loss's backward reads) and its phase is a whole
forward or backward (a split backward's I holds its weight gradients back for W).

Its kind: phase, chunk, whether it has an input, the last compute op before it on the rank
(its first ops wait for the host there), named with its micro-batches relative to the
action's, and each pass's
``action_key`` for its micro-batch (what besides the micro-batch's labels the pass's ops
depend on; None: it keeps state across actions, and the action keeps the generic code).

Record: each op's name and tag with their micro-batch tokens (twin/schedule/names.py) as
offsets from the action's micro-batch, its other fields as constants, its dependencies as
offsets inside the action or, outside it, the action's input, the last compute op before
it, or an op found by its name (tokens moved); and where it leaves the last compute op.
The next action of the kind is built by the generic code too and compared with its stamp;
from then on the kind is stamped, each copy listed in Program.blocks (one entry for the
action: the simulator's per-op passes tile it). A kind whose stamp differs is recorded again
from that action, up to ``TRIES`` times, then stays generic; so does one whose named
dependency a later action cannot find. The check compares two actions of a kind: a pass
whose ops change with the micro-batch in a way two of them may not show (DDP's buckets,
only in the last) says so by its ``action_key``. The programs are the generic code's, op
for op (tests/sim/test_build_speedups.py).
"""

from __future__ import annotations

from collections.abc import Callable

from twin.schedule import stamp
from twin.schedule.emit import Idx, ProgramBuilder
from twin.schedule.ir import Op
from twin.schedule.names import mb_tokens
from twin.schedule.stamp import _REST, compiled, op_source

ENABLED = True
"""Stamp whole actions (False: layer bodies only, as stamp.ENABLED allows them)."""
TRIES = 3
"""Records of one kind before it stays generic."""
AHEAD = 32
"""A kind is recorded only while at least this many micro-batches are still to come: a
record (and compiling it) costs about what stamping saves on a few dozen copies, so a short
run (or the tail of one) keeps the generic code."""
_TEXT = ("kind", "stream", "phase", "paradigm", "dtype", "group_name", "category")
"""An op's other text fields: a micro-batch token there keeps the action generic."""
_X, _LAST = -1, -2  # an external dependency: the action's input; the last compute op before it


class ActionTemplate:
    """One recorded action: ``emit(ops, names, lookup, base, mb, x, last)`` appends its ops
    (KeyError before any: an op it depends on by name is missing); ``size`` ops, and as
    offsets from its first op its output (or _X, _LAST: the input, the last compute op
    before it) and its last compute op (None: none inside). ``names``: its ops' names with
    their micro-batches relative to the action's, which ActionStamper turns into their
    number on the rank (actions whose names number alike name their ops alike, op for op:
    twin.sim.fastforward.counterparts maps one onto the other)."""

    __slots__ = ("emit", "size", "out", "last_compute", "names")

    def __init__(self, emit, size, out, last_compute, names):
        self.emit, self.size, self.out, self.last_compute = emit, size, out, last_compute
        self.names = names


class _Source:
    """The generated function: the micro-batches' strings and the named dependencies bound
    first (a missing name raises before any op is appended), then the ops."""

    def __init__(self, mb: int):
        self.mb = mb
        self.offsets: dict[int, str] = {}  # micro-batch offset -> the variable of its string
        self.named: dict[tuple, str] = {}  # (pieces, offsets) of a dependency's name -> variable
        self.lookups: list[str] = []
        self.ops: list[str] = []

    def _expr(self, pieces: tuple[str, ...], mbs: tuple[int, ...], piece) -> str:
        out = []
        for k, p in enumerate(pieces):
            if p:
                out.append(piece(k, p))
            if k < len(mbs):
                off = mbs[k] - self.mb
                out.append(self.offsets.setdefault(off, f"m{len(self.offsets)}"))
        return " + ".join(out) or "''"

    def text(self, pieces: tuple[str, ...], mbs: tuple[int, ...], consts: list) -> str:
        """The expression of an op's name or tag (split by ``mb_tokens``); its pieces
        appended to the op's recorded fields ``consts`` (``r``)."""
        def piece(_k, p):
            consts.append(p)
            return f"r[{len(consts) - 1}]"
        return self._expr(pieces, mbs, piece)

    def dep(self, name: str) -> str:
        """The variable of the op named ``name`` (its tokens moved with the micro-batch)."""
        pieces, mbs = mb_tokens(name)
        key = (pieces, tuple(m - self.mb for m in mbs))
        v = self.named.get(key)
        if v is None:
            n = len(self.named)
            v = self.named[key] = f"e{n}"
            self.lookups.append(f"    {v} = lookup[{self._expr(pieces, mbs, lambda k, _p: f'N[{n}][{k}]')}]")
        return v

    def function(self) -> list[str]:
        return ["def emit(ops, names, lookup, base, mb, x, last):",
                *(f"    {v} = 'mb' + str(mb + {off})" for off, v in self.offsets.items()),
                *self.lookups, "    append = ops.append", *self.ops]


def record(b: ProgramBuilder, start: int, mb: int, x: Idx, last: Idx,
           out: Idx) -> ActionTemplate | None:
    """The template of the ops ``b`` emitted from ``start`` on for an action of micro-batch
    ``mb`` with input ``x``, ``last`` the last compute op before it, ``out`` its output;
    None: it cannot be stamped."""
    src, consts, ops, names = _Source(mb), [], b.ops, []
    for j, op in enumerate(ops[start:]):
        texts = [getattr(op, f) for f in _TEXT]
        if type(op) is not Op or op.mb != mb \
                or any(mb_tokens(t)[1] for t in texts if "mb" in t):
            return None
        rest = [getattr(op, f) for f in _REST]
        k = len(rest)
        rest += (op.phase, op.layer, op.chunk)
        pieces, mbs = mb_tokens(op.name)
        name = src.text(pieces, mbs, rest)
        names.append((pieces, tuple(m - mb for m in mbs)))
        tag = mb_tokens(op.tag) if "mb" in op.tag else None
        tag = src.text(*tag, rest) if tag and tag[1] else None
        ext = [("x" if d == x else "last" if d == last else src.dep(ops[d].name))
               for d in op.deps if d < start]
        inner = "".join(f"base + {d - start}, " for d in op.deps[len(ext):])
        if len(ext) <= 1:
            deps = f"({''.join(f'{e}, ' for e in ext)}{inner})"
        else:  # two outside may be one op here (the input made last), or come in either order
            deps = f"tuple(sorted({{{', '.join(ext)}}})) + ({inner})"
        src.ops += op_source(j, name, op.kind, op.stream, deps, op.paradigm,
                             (f"r[{k}]", f"r[{k + 1}]", "mb", f"r[{k + 2}]"), tag)
        consts.append(tuple(rest))
    lc = b.last_compute
    if out is not None and out < start and out not in (x, last) \
            or lc != last and (lc is None or lc < start):
        return None
    emit = compiled(src.function(), consts, N=tuple(p for p, _ in src.named))
    return ActionTemplate(emit, len(ops) - start,
                          None if out is None else out - start if out >= start else
                          _X if out == x else _LAST,
                          None if lc == last else lc - start, tuple(names))


def _out(t: ActionTemplate, base: int, x: Idx, last: Idx) -> Idx:
    o = t.out
    return None if o is None else x if o == _X else last if o == _LAST else base + o


class ActionStamper:
    """A rank's action templates by kind (see the module docstring)."""

    def __init__(self, b: ProgramBuilder, passes: list, microbatches: int):
        self.b, self.passes, self.microbatches = b, passes, microbatches
        self.templates: dict[tuple, ActionTemplate | None] = {}
        self.checked: dict[tuple, ActionTemplate] = {}
        """The kinds whose second action matched its stamp: stamped from then on."""
        self.tries: dict[tuple, int] = {}
        self.names: dict[tuple, int] = {}  # a template's names -> their number (ActionTemplate)

    def _key(self, phase: str, mb: int, chunk: int, x: Idx) -> tuple | None:
        keys = tuple(p.action_key(mb) for p in self.passes)
        if None in keys:
            return None
        last = self.b.last_compute
        if last is not None:  # where the host stands: that op's name, micro-batches relative
            op = self.b.ops[last]
            name = op.name
            if op.mb < 0:  # an op of no micro-batch: its name as it is
                last = (name, None)
            elif name.count("mb") == 1:  # (most names: one token, the op's own micro-batch)
                last = (name.replace(f"mb{op.mb}", "", 1), op.mb - mb)
            else:
                pieces, mbs = mb_tokens(name)
                last = (pieces, tuple(m - mb for m in mbs))
        return (phase, chunk, x is None, last, keys)

    def __call__(self, phase: str, mb: int, chunk: int, x: Idx, body: Callable[[], Idx]) -> Idx:
        """The output of the action ``body()`` would emit (phase F or B of ``chunk`` on
        micro-batch ``mb``, input ``x``), stamped where its kind allows."""
        key = self._key(phase, mb, chunk, x) if stamp.ENABLED and ENABLED else None
        if key is None:
            return body()
        t = self.checked.get(key)
        if t is not None:
            out = self._stamp(t, phase, mb, chunk, x)
            if out is not _MISSING:
                return out
            del self.checked[key]
            self.templates[key] = None
            return body()
        t = self.templates.get(key, False)
        if t is None:
            return body()
        b = self.b
        start, last = len(b.ops), b.last_compute
        out = body()
        if t is False:  # not recorded yet: only while enough copies may follow to repay it
            if self.microbatches - mb < AHEAD:
                return out
        elif _same(b, t, start, mb, x, last, out):
            self.checked[key] = t
            return out
        tries = self.tries[key] = self.tries.get(key, 0) + 1
        t = self.templates[key] = record(b, start, mb, x, last, out) if tries <= TRIES else None
        if t is not None:
            t.names = self.names.setdefault(t.names, len(self.names))
        return out

    def _stamp(self, t: ActionTemplate, phase: str, mb: int, chunk: int, x: Idx):
        b = self.b
        ops, names, last = b.ops, b._names, b.last_compute
        base, before = len(ops), len(names)
        try:
            t.emit(ops, names, names, base, mb, x, last)
        except KeyError:  # raised before any op is appended
            return _MISSING
        if len(names) != before + t.size:  # a name the program had already
            raise AssertionError(f"duplicate op name in action of micro-batch {mb} on rank "
                                 f"{b.rank}")
        b.blocks.append((t, phase, -1, chunk, mb, base))
        if t.last_compute is not None:
            b.last_compute = base + t.last_compute
        return _out(t, base, x, last)


_MISSING = object()


def _same(b: ProgramBuilder, t: ActionTemplate, start: int, mb: int, x: Idx, last: Idx,
          out: Idx) -> bool:
    """Whether ``t`` stamped at ``start`` gives what the generic code just emitted there."""
    ops: list[Op] = []
    try:
        t.emit(ops, {}, b._names, start, mb, x, last)
    except KeyError:
        return False
    lc = last if t.last_compute is None else start + t.last_compute
    return ops == b.ops[start:] and lc == b.last_compute and _out(t, start, x, last) == out
