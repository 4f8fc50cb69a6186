"""ProgramBuilder: appends ops to one rank's program with labels, names and byte counts."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields

from twin.schedule.ir import Op, Program
from twin.spec import Job
from twin.spec.job import FLOAT8_PEAK
from twin.spec.parallel import OPTIMIZER_STATE_BYTES
from twin.workload.loss import compiled_loss
from twin.workload.params import FP8_LINEARS

Idx = int | None
Deps = Iterable  # of Idx, possibly nested


@dataclass(frozen=True)
class Ctx:
    """Labels of the ops being emitted: phase, micro-batch, chunk, layer, paradigm."""

    phase: str = "fwd"
    mb: int = -1
    chunk: int = -1
    layer: int = -1
    paradigm: str = ""

    def prefix(self) -> str:
        cached = self.__dict__.get("_prefix")  # the same context names every op of a unit
        if cached is not None:
            return cached
        parts = [self.phase]
        if self.mb >= 0:
            parts.append(f"mb{self.mb}")
        if self.layer >= 0:
            parts.append(f"L{self.layer}")
        elif self.chunk >= 0:
            parts.append(f"c{self.chunk}")
        out = self.__dict__["_prefix"] = "/".join(parts)
        return out

    @staticmethod
    def of(phase: str, mb: int = -1, chunk: int = -1, layer: int = -1, paradigm: str = "") -> Ctx:
        """Ctx(...) without the frozen dataclass's __init__ (its fields set directly)."""
        out = _new(Ctx)
        out.__dict__.update(phase=phase, mb=mb, chunk=chunk, layer=layer, paradigm=paradigm)
        return out

    def at(self, **kw) -> Ctx:
        out = _new(Ctx)  # as Ctx.of
        d = out.__dict__
        d.update(phase=kw.get("phase", self.phase), mb=kw.get("mb", self.mb),
                 chunk=kw.get("chunk", self.chunk), layer=kw.get("layer", self.layer),
                 paradigm=kw.get("paradigm", self.paradigm))
        if len(kw) == 1 and "paradigm" in kw:
            d["_prefix"] = self.prefix()  # the prefix does not name the paradigm
        return out


_new = object.__new__


def _flatten(deps) -> Iterable[int]:
    for d in deps:
        if isinstance(d, (list, tuple)):
            yield from _flatten(d)
        elif d is not None:
            yield d


def _dep_tuple(deps) -> tuple[int, ...]:
    """The sorted distinct indices of ``deps`` (ints, None, or nested lists of them)."""
    if deps.__class__ is list and len(deps) == 1 and deps[0].__class__ is int:
        return (deps[0],)  # the common case: one dependency
    out = set()
    for d in deps:
        if d.__class__ is int:
            out.add(d)
        elif d is not None:
            out.update(_flatten((d,)))
    return tuple(sorted(out))


def _op_factory():
    """Op(...) without the frozen dataclass's checks (a third of the time of building a large
    program went to Op.__init__): the slots are stored on an instance of a plain class of
    the same layout, which then becomes an Op (``__class__`` assignment between classes with
    the same slots), still frozen."""
    names = [f.name for f in fields(Op)]
    required = ("name", "kind", "stream")
    args = ", ".join(n if n in required else f"{n}={f.default!r}"
                     for n, f in zip(names, fields(Op)))
    body = "".join(f"    op.{n} = {n}\n" for n in names)
    env = {"_Slots": type("_OpSlots", (), {"__slots__": tuple(Op.__slots__)}), "Op": Op}
    exec(f"def make_op({args}):\n    op = _Slots()\n{body}    op.__class__ = Op\n    return op\n",  # noqa: S102
         env)
    return env["make_op"]


make_op = _op_factory()


class ProgramBuilder:
    """Emits ops for ``rank`` of ``job`` (the emitter context every pass writes through);
    names are rank-independent so members of a group give their shared collectives the
    same name. It keeps only the rank and the dtype: passes are given the plan fields
    they need, never the job."""

    def __init__(self, job: Job, rank: int):
        self.rank = rank
        self.ops: list[Op] = []
        self._names: dict[str, int] = {}
        self.e = job.model.dtype_bytes
        self.dtype = job.model.dtype
        self.linear_dtype = FLOAT8_PEAK.get(job.parallel.float8)
        """The transformer layers' linear GEMMs' dtype under FP8 training (None: the model's)."""
        self.compiled = job.parallel.compile
        """torch.compile of each block: FP8 casts of activations fuse their amax (``gemm``)."""
        self.compiled_loss = compiled_loss(job.parallel)
        """The loss compiled too (twin.workload.loss.compiled_loss): not outside_blocks."""
        self.state_bytes = OPTIMIZER_STATE_BYTES[job.parallel.optimizer_dtype]
        """Bytes of one of Adam's momentum or variance elements."""
        self.last_compute: Idx = None
        """The latest compute op: where the host stands when it issues the next op."""
        self.blocks: list[tuple] = []
        """The bodies stamped so far (Program.blocks)."""
        self.gemm_paradigm = ""
        """The paradigm of this rank's GEMMs where their context names none: tp or sp when
        its linears are tensor-parallel (TensorParallel sets it; Op.tp_gemm)."""

    # -- generic -----------------------------------------------------------------
    def emit(self, ctx: Ctx, local: str, kind: str, stream: str, deps: Iterable[Idx] = (),
             paradigm: str | None = None, **fields) -> int:
        """Append an op named ``{ctx's prefix}/{local}`` labelled by ``ctx`` (``paradigm``: in
        place of the context's, as ``ctx.at(paradigm=...)`` would label it); its index."""
        name = f"{ctx.prefix()}/{local}"
        names, ops = self._names, self.ops
        if name in names:
            raise AssertionError(f"duplicate op name {name!r} on rank {self.rank}")
        idx = len(ops)
        ops.append(make_op(name, kind, stream, _dep_tuple(deps), ctx.phase,
                           ctx.paradigm if paradigm is None else paradigm, ctx.layer, ctx.mb,
                           ctx.chunk, **fields))
        names[name] = idx
        if kind in ("gemm", "attention", "elementwise", "optimizer"):
            self.last_compute = idx
        return idx

    def program(self) -> Program:
        return Program(self.rank, self.ops, blocks=self.blocks)

    # -- compute -----------------------------------------------------------------
    def fp8_cast(self, ctx: Ctx, local: str, act: int, weight: int, deps: Iterable[Idx]) -> int:
        """An FP8 cast of ``act`` activation and ``weight`` weight elements (see ``gemm``)."""
        e = self.e
        nbytes = act * (e + 1 if self.compiled else 2 * e + 1) + weight * (2 * e + 1)
        return self.elementwise(ctx, f"{local}.fp8_cast", act + weight, deps,
                                tensors=nbytes / (e * (act + weight)), flops_per_element=2)

    def gemm(self, ctx: Ctx, local: str, m: int, n: int, k: int, deps: Iterable[Idx],
             flops_scale: float = 1.0, weight_cast: bool = True, act_cast: bool = True) -> int:
        """(m x k) @ (k x n): 2mnk FLOPs, e(mk + kn + mn) bytes. Under FP8 training a layer's
        linear GEMM (forward, dgrad and wgrad) first casts its two operands (dynamic scaling:
        an amax read, then a cast that reads e and writes 1 byte per element; torchao's
        Float8Linear keeps the high-precision tensors for backward and casts again there),
        then multiplies 1-byte operands into an e-byte output at the FP8 peak. Under
        torch.compile (``compiled``) the amax of an activation or gradient operand is fused
        into the compiled kernel that produces it, so its cast reads e and writes 1 byte per
        element; a weight (the k x n operand of the forward and dgrad GEMMs, gathered by
        FSDP, made by no compiled kernel) still pays its amax read. ``weight_cast=False``:
        the weight was cast already (async TP's partial GEMMs after the first cast it once);
        ``act_cast=False``: the activation arrives in FP8 (gathered so by SP)."""
        if self.gemm_paradigm and not ctx.paradigm:
            ctx = ctx.at(paradigm=self.gemm_paradigm)
        if self.linear_dtype and local.split(".")[0] in FP8_LINEARS:
            wgrad = local.endswith(".wgrad")  # two activations
            act = m * k + (k * n if wgrad else 0) if act_cast else 0
            weight = 0 if wgrad or not weight_cast else k * n
            if act + weight:
                deps = [self.fp8_cast(ctx, local, act, weight, deps)]
            return self.emit(ctx, local, "gemm", "compute", deps, shape=(m, n, k),
                             dtype=self.linear_dtype, flops=2.0 * m * n * k * flops_scale,
                             bytes=float(m * k + k * n + self.e * m * n))
        return self.emit(ctx, local, "gemm", "compute", deps, shape=(m, n, k), dtype=self.dtype,
                         flops=2.0 * m * n * k * flops_scale,
                         bytes=float(self.e * (m * k + k * n + m * n)))

    def attention(self, ctx: Ctx, local: str, batch: int, heads: int, kv_heads: int, seq: int,
                  head_dim: int, deps: Iterable[Idx], flops_scale: float = 1.0,
                  eager: bool = False) -> int:
        """Causal attention core: 4*b*heads*s^2*d FLOPs forward (MFU convention, full square).

        Bytes: Q, K, V read and O written; eager attention also makes about six passes over
        the b*heads*s^2 scores (QK^T written; scale, mask and softmax read and write them;
        dropout reads them and writes its output; AV reads it), in 16-bit. ``shape[5]``
        (causal) is 1 when the kernel skips the masked half (flash attention) and 0 when it
        computes the full square and masks (eager).
        """
        flops = 4.0 * batch * heads * seq * seq * head_dim * flops_scale
        nbytes = self.e * batch * seq * head_dim * (2 * heads + 2 * kv_heads) * flops_scale
        if eager:
            nbytes += 6 * self.e * batch * heads * seq * seq * flops_scale
        return self.emit(ctx, local, "attention", "compute", deps,
                         shape=(batch, heads, kv_heads, seq, head_dim, 0 if eager else 1),
                         dtype=self.dtype,
                         flops=flops, bytes=float(nbytes))

    def elementwise(self, ctx: Ctx, local: str, elements: int, deps: Iterable[Idx],
                    tensors: float = 2.0, flops_per_element: float = 1.0,
                    one_kernel: bool = False, reduction: bool = False,
                    compiled: bool = False) -> int:
        """A memory-bound op touching ``tensors`` tensors of ``elements`` each. The layers'
        ops stand for fused kernels that eager PyTorch runs as several (the profile's
        ``eager_elementwise``); ``one_kernel``: one kernel in eager PyTorch too, e.g. FSDP2's
        copies (``shape`` (elements, 1): no eager factor, CostModel.kernel_of);
        ``reduction``: it reduces along rows, a norm or the loss (``shape`` (elements, 0, 1):
        CostModel.compiled_reduction_efficiency). An op outside the layers (``ctx.layer`` < 0:
        the embedding, final norm, loss, gradient clipping) that is not one kernel anyway
        stays eager under torch.compile of each block (``shape`` (elements, 0, reduction,
        1): Op.outside_blocks) unless ``compiled`` (the loss under parallel.compile_loss)."""
        if ctx.layer < 0 and not one_kernel and not compiled:
            shape = (elements, 0, int(reduction), 1)
        else:
            shape = (elements, int(one_kernel), 1) if reduction else \
                (elements, 1) if one_kernel else (elements,)
        return self.emit(ctx, local, "elementwise", "compute", deps, shape=shape,
                         dtype=self.dtype, flops=float(elements * flops_per_element),
                         bytes=float(self.e * elements * tensors))

    def optimizer(self, ctx: Ctx, local: str, params: int, deps: Iterable[Idx],
                  fused: bool = True) -> int:
        """Adam over ``params``, about 10 FLOPs each. Fused: one pass that reads and writes the
        fp32 master, momentum and variance (24 B) and reads the grad and writes the param
        (2e B). Foreach (PyTorch's default): a pass per step of the update, in fp32: the
        momentum lerp (r/w, 8 B) and its read in the update (4 B); the variance scaled and
        accumulated (2 x r/w, 16 B) and read by the square root (4 B); the denominator written
        by the root, divided and shifted by eps in place (4 + 8 + 8 B) and read by the update
        (4 B); the master read and written (8 B): 64 B, plus the grad and param (2e B).
        With bf16 states (``optimizer_dtype``) each byte of momentum and variance traffic
        halves: fused 8 + 8 B, foreach 8 + 28 B. ``shape``: (params, 1 if fused else 0)."""
        states = (16 if fused else 56) * self.state_bytes / 4  # everything but the master's 8 B
        per_param = 8 + states + 2 * self.e
        return self.emit(ctx, local, "optimizer", "compute", deps, shape=(params, int(fused)),
                         dtype=self.dtype, flops=10.0 * params, bytes=float(params * per_param))

    # -- communication -----------------------------------------------------------
    def collective(self, ctx: Ctx, local: str, kind: str, group: tuple[int, ...],
                   group_name: str, nbytes: float, deps: Iterable[Idx], stream: str = "comm",
                   root: int = -1, dtype: str | None = None) -> Idx:
        """A collective over ``group`` of elements of ``dtype`` (None: the model's); skipped
        (returns None) when the group is one rank."""
        if len(group) <= 1:
            return None
        return self.emit(ctx, local, kind, stream, deps, group=tuple(group),
                         group_name=group_name, bytes=float(nbytes), root=root,
                         dtype=dtype or self.dtype)

    def send(self, ctx: Ctx, local: str, peer: int, tag: str, nbytes: float,
             deps: Iterable[Idx], group_name: str = "pp", paradigm: str | None = None) -> int:
        return self.emit(ctx, local, "send", "p2p", deps, paradigm, peer=peer, tag=tag,
                         bytes=float(nbytes), group_name=group_name, dtype=self.dtype)

    def recv(self, ctx: Ctx, local: str, peer: int, tag: str, nbytes: float,
             deps: Iterable[Idx], group_name: str = "pp", paradigm: str | None = None) -> int:
        return self.emit(ctx, local, "recv", "p2p", deps, paradigm, peer=peer, tag=tag,
                         bytes=float(nbytes), group_name=group_name, dtype=self.dtype)

    # -- memory ------------------------------------------------------------------
    def alloc(self, ctx: Ctx, buffer: str, category: str, nbytes: float,
              deps: Iterable[Idx] = ()) -> int:
        """Allocate when the host reaches this point (after the latest compute op) and ``deps``."""
        return self.emit(ctx, f"alloc.{buffer}", "alloc", "mem", [deps, self.last_compute],
                         category=category,
                         bytes=float(nbytes), tag=buffer)

    def free(self, ctx: Ctx, buffer: str, category: str, nbytes: float,
             deps: Iterable[Idx] = ()) -> int:
        return self.emit(ctx, f"free.{buffer}", "free", "mem", deps, category=category,
                         bytes=float(nbytes), tag=buffer)
