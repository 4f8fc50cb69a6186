"""Record and stamp: a layer body's ops built once per rank, then copied for every other
micro-batch and layer.

A dense layer's forward (or backward) emits the same ops at every micro-batch and layer of
a stage: only the names' prefix (``fwd/mb3/L7``), the micro-batch, layer and chunk labels
and the dependency indices differ. The first body of each kind is built by the generic code
and recorded: per op its name past the prefix, its fields, and its dependencies as offsets
inside the body plus the input it reads (one of the body's inputs, as ``_dep_tuple`` gives
them). The second body of the kind is built by the generic code too and compared with its
stamp; later ones are stamped from the record: the same Program as the generic code, op for
op (tests/sim/test_build_speedups.py). A send/recv tag that starts with the body's prefix
(async TP's copies are tagged by their body's name) is recorded past it, as names are. A
kind whose record would not hold (an op labelled
other than its context, a dependency on an op before the body that is not one of its
inputs, an output outside it) or whose stamp differed stays generic. Only dense layer
bodies without context parallelism or a split backward's held-back weight gradients are
offered (TensorParallel._stamps)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from types import NoneType

from twin.schedule.emit import Ctx, Idx, ProgramBuilder, _dep_tuple
from twin.schedule.ir import Op

ENABLED = True
"""Stamp repeated layer bodies (False: every body through the generic code; the tests
compare the two)."""

_REST = tuple(f.name for f in fields(Op))[9:]  # shape .. recv_splits: copied as recorded
assert tuple(f.name for f in fields(Op))[:9] == (
    "name", "kind", "stream", "deps", "phase", "paradigm", "layer", "mb", "chunk")


class Template:
    """One recorded body: ``emit(ops, names, base, prefix, phase, layer, mb, chunk, slots)``
    appends its ops (generated code: the fields written as constants, the dependencies as
    offsets from ``base`` after the input slot they read), and the offsets of its output,
    last compute op and gradients."""

    __slots__ = ("emit", "size", "out", "last_compute", "grads")

    def __init__(self, emit, size, out, last_compute, grads):
        self.emit, self.size = emit, size
        self.out, self.last_compute, self.grads = out, last_compute, grads


def _deps_code(slot: int, offs: tuple[int, ...]) -> str:
    inner = "".join(f"base + {o}, " for o in offs)
    if slot < 0:
        return f"({inner})"
    return f"s{slot} + ({inner})" if offs else f"s{slot}"


def _compile(rec: list[tuple], n_slots: int):
    """The function that appends the recorded ops (see Template)."""
    lines = ["def emit(ops, names, base, prefix, phase, layer, mb, chunk, slots):",
             "    append = ops.append"]
    lines += [f"    s{k} = slots[{k}]" for k in range(n_slots)]
    for j, (local, kind, stream, slot, offs, paradigm, rest) in enumerate(rec):
        tag = rest[_TAG]
        lines += op_source(j, f"prefix + {local!r}", kind, stream, _deps_code(slot, offs),
                           paradigm, ("phase", "layer", "mb", "chunk"),
                           f"prefix + {str(tag)!r}" if isinstance(tag, _Local) else None)
    return compiled(lines, [r[-1] for r in rec])


def op_source(j: int, name: str, kind: str, stream: str, deps: str, paradigm: str,
              labels: tuple[str, str, str, str], tag: str | None) -> list[str]:
    """Source lines of a template's function that append its op ``j``: ``name``, ``deps``,
    the ``labels`` (phase, layer, mb, chunk) and ``tag`` (None: as recorded) are
    expressions; the other fields are the recorded ones (``K[j]``, as ``_REST`` names them).
    The function has ``ops``, ``names`` and ``base`` and has bound ``append``."""
    phase, layer, mb, chunk = labels
    sets = _SETS if tag is None else _SETS.replace(f"o.tag = r[{_TAG}]", f"o.tag = {tag}")
    return [f"    o = _Slots(); r = K[{j}]",
            f"    o.name = n = {name}",
            f"    o.kind = {kind!r}; o.stream = {stream!r}; o.deps = {deps}",
            f"    o.phase = {phase}; o.paradigm = {paradigm!r}",
            f"    o.layer = {layer}; o.mb = {mb}; o.chunk = {chunk}",
            sets, "    o.__class__ = Op; append(o)",
            f"    names[n] = base + {j}"]


def compiled(lines: list[str], consts: list[tuple], **more):
    """The function ``lines`` define (named ``emit``), its ops' recorded fields ``consts``
    (``K``) and ``more`` constants bound: compiled once per source."""
    source = "\n".join(lines) + "\n"
    code = _CODE.get(source)  # every stage's bodies read alike: their constants differ
    if code is None:
        if len(_CODE) >= 256:
            _CODE.clear()
        code = _CODE[source] = compile(source, "<stamp>", "exec")
    env = {"_Slots": _SLOTS, "Op": Op, "K": tuple(consts), **more}
    exec(code, env)  # noqa: S102
    return env["emit"]


_CODE: dict[str, object] = {}
"""Compiled templates by their source."""


_SLOTS = type("_StampSlots", (), {"__slots__": tuple(Op.__slots__)})
_TAG = _REST.index("tag")
_SETS = "    " + "; ".join(f"o.{f} = r[{k}]" for k, f in enumerate(_REST))
"""The recorded fields' assignments (op_source)."""


class _Local(str):
    """A send/recv tag recorded past the body's prefix (async TP's copies are tagged by
    their body's name): the stamp writes the prefix before it."""


def record(b: ProgramBuilder, start: int, ctx: Ctx, slots: tuple[tuple[int, ...], ...],
           out: Idx, last_before: Idx, grads: dict | None) -> Template | None:
    """The template of the ops ``b`` emitted from ``start`` on under ``ctx`` (None: they
    cannot be stamped)."""
    prefix = ctx.prefix() + "/"
    cut = len(prefix)
    rec = []
    for op in b.ops[start:]:
        if (op.phase, op.layer, op.mb, op.chunk) != (ctx.phase, ctx.layer, ctx.mb, ctx.chunk) \
                or not op.name.startswith(prefix) or type(op) is not Op:
            return None
        ext = tuple(d for d in op.deps if d < start)
        offs = tuple(d - start for d in op.deps if d >= start)
        slot = -1
        if ext:
            match = [k for k, s in enumerate(slots) if s == ext]
            if len(match) != 1:
                return None
            slot = match[0]
        rest = tuple(getattr(op, f) for f in _REST)
        if op.tag.startswith(prefix):
            rest = (*rest[:_TAG], _Local(op.tag[cut:]), *rest[_TAG + 1:])
        rec.append((op.name[cut:], op.kind, op.stream, slot, offs, op.paradigm, rest))
    if out is None or out < start:
        return None
    last = b.last_compute
    if last != last_before and (last is None or last < start):
        return None
    gr = None
    if grads is not None:
        if any(v is None or v < start for v in grads.values()):
            return None
        gr = tuple((k, v - start) for k, v in grads.items())
    return Template(_compile(rec, len(slots)), len(rec), out - start,
                    None if last == last_before else last - start, gr)


def stamp(b: ProgramBuilder, t: Template, ctx: Ctx, slots: tuple[tuple[int, ...], ...],
          grads: dict | None) -> int:
    """Append ``t``'s ops under ``ctx``; returns the body's output."""
    ops, names = b.ops, b._names
    base, before = len(ops), len(names)
    t.emit(ops, names, base, ctx.prefix() + "/", ctx.phase, ctx.layer, ctx.mb, ctx.chunk, slots)
    if len(names) != before + t.size:  # a name the program had already
        seen = set()
        for op in ops[base:]:
            if op.name in seen or names[op.name] < base:
                raise AssertionError(f"duplicate op name {op.name!r} on rank {b.rank}")
            seen.add(op.name)
    return placed(b, t, ctx, base, grads)


def placed(b: ProgramBuilder, t: Template, ctx: Ctx, base: int, grads: dict | None) -> int:
    """What the builder learns of ``t``'s body appended at ``base``: the block, its last
    compute op and gradients; returns the body's output."""
    b.blocks.append((t, ctx.phase, ctx.layer, ctx.chunk, ctx.mb, base))
    if t.last_compute is not None:
        b.last_compute = base + t.last_compute
    if t.grads is not None:
        for k, off in t.grads:
            grads[k] = base + off
    return base + t.out


def _slot(x) -> tuple[int, ...]:
    """``_dep_tuple([x])``: the distinct ops of ``x`` sorted (fast for one op, or a unit's
    input with no other dependencies)."""
    c = x.__class__
    if c is int:
        return (x,)
    if c is list and len(x) == 2 and x[0].__class__ is int and not x[1] \
            and x[1].__class__ in (list, NoneType):
        return (x[0],)
    return _dep_tuple([x])


class Stamper:
    """A rank's templates, by the body's kind (``key``: everything the body's ops depend on
    besides the context's labels and the inputs' indices). The first body of a kind is
    recorded; the second is built by the generic code too and compared with its stamp
    (``checked``): a kind whose stamp differs stays generic; later ones are stamped."""

    def __init__(self, b: ProgramBuilder):
        self.b = b
        self.templates: dict[tuple, Template | None] = {}
        self.checked: dict[tuple, Template] = {}
        """The kinds whose second body matched its stamp: stamped from then on."""

    def __call__(self, key: tuple, ctx: Ctx, inputs: tuple, grads: dict | None,
                 body: Callable[[], Idx]) -> Idx:
        """The body ``body()`` would emit under ``ctx`` from ``inputs`` (each an op, None, or
        a nested list of them, as the body's ops depend on it), filling ``grads`` (None: the
        body has none)."""
        slots = tuple(map(_slot, inputs))
        key = (key, ctx.phase, ctx.paradigm, tuple(map(bool, slots)))
        t = self.checked.get(key)
        if t is not None and not grads:
            return stamp(self.b, t, ctx, slots, grads)
        t = self.templates.get(key, False)
        if t is None or grads:  # not stampable, or gradients already in the dict
            return body()
        b = self.b
        start, last = len(b.ops), b.last_compute
        out = body()
        if t is False:
            self.templates[key] = record(b, start, ctx, slots, out, last, grads)
        elif _same(b, t, start, ctx, slots, out, last, grads):
            self.checked[key] = t
        else:
            self.templates[key] = None
        return out


def _same(b: ProgramBuilder, t: Template, start: int, ctx: Ctx, slots: tuple, out: Idx,
          last_before: Idx, grads: dict | None) -> bool:
    """Whether ``t`` stamped at ``start`` gives what the generic code just emitted there."""
    ops: list[Op] = []
    t.emit(ops, {}, start, ctx.prefix() + "/", ctx.phase, ctx.layer, ctx.mb, ctx.chunk, slots)
    last = None if b.last_compute == last_before else b.last_compute
    return ops == b.ops[start:] and out == start + t.out \
        and last == (None if t.last_compute is None else start + t.last_compute) \
        and (t.grads is None) == (grads is None) \
        and (grads is None or tuple((k, v - start) for k, v in grads.items()) == t.grads)
