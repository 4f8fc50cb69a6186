"""ZeRO-3 / FSDP: per-unit parameter all-gather and gradient reduce-scatter over the DP group.

FSDP2 (``fully_shard`` per transformer layer plus a root unit holding the embedding
and the head): a unit's parameters are all-gathered before its forward and, when
``fsdp_reshard_after_forward``, freed after it and gathered again before its backward;
after its backward the unit's gradients are reduce-scattered and its parameters freed.
One unit is prefetched: the next layer's all-gather is issued when the current one is
(on its own stream), so at most two units are gathered at once (ZeRO §5.3; PyTorch FSDP
paper, Zhao et al. 2023, §3.3). Gradients are reduce-scattered every micro-batch unless
``grad_sync`` says otherwise. The root stays gathered after forward; its gradients are
reduce-scattered once both its parts' backwards are done on a stage that holds both (one
chunk), else after each part's.

FSDP2's copies (torch.distributed.fsdp._fully_shard._fsdp_collectives), on the compute
stream where FSDP2 runs them: a gathered unit is copied out of the all-gather's flat output
into its parameters (``split_with_sizes_copy``: the gathered bytes read and written) just
before the unit first computes with it, and a unit's gradients are copied into the
reduce-scatter's flat input (``foreach_reduce_scatter_copy_in``: read at the gradient's
dtype, written at the reduce dtype) before the reduce-scatter. The all-gather's copy-in (1/dp
of the unit, on its own stream) and the post-reduce cast of the shard are not modelled.

The reduce dtype (``fsdp_reduce_dtype``): fp32 by default, as torchtitan's
``mixed_precision_reduce``; a bf16 model's gradients are then cast up in the copy-in, and
the reduce-scatter (and HSDP's all-reduce) move 4 bytes per gradient element.

HSDP (FSDP2 on a 2-D mesh, ``dp_replicate`` > 1): the gathers and reduce-scatters run over
the rank's dp_shard group, and each reduce-scattered shard is then all-reduced across its
dp_replicate group on its own stream (FSDP2's ``all_reduce_stream``), 1/dp_shard of the unit.
"""

from __future__ import annotations

from twin.schedule.emit import Ctx, Idx, ProgramBuilder
from twin.schedule.passes import EMBED, HEAD_UNIT, LAYER, Pass, Unit
from twin.schedule.stage import ROOT, StageLayout
from twin.spec import ParallelPlan, RankGrid
from twin.spec.model import DTYPE_BYTES
from twin.workload.params import is_fp8_weight


def apply_fsdp(out: ProgramBuilder, par: ParallelPlan, layout: StageLayout,
               grid: RankGrid) -> FSDP | None:
    """ZeRO-3 / FSDP over the rank's DP group, or HSDP over its dp_shard group with the
    dp_replicate all-reduce (None unless zero_stage=3 with dp > 1)."""
    if par.legacy_dp or par.dp * par.cp <= 1 or par.zero_stage != 3:
        return None
    hsdp = par.dp_replicate > 1
    role = "dp_shard" if hsdp else ("dp-cp" if par.cp > 1 else "dp")  # CP ranks shard too
    replicate = grid.group(out.rank, "dp_replicate") if hsdp else ()
    fsdp = FSDP(out, grid.group(out.rank, role), layout.units, reshard=par.fsdp_reshard_after_forward,
                every_mb=par.sync_every_microbatch, last_mb=par.num_microbatches - 1,
                one_chunk=layout.num_chunks == 1, replicate=replicate, role=role,
                reduce_dtype=par.fsdp_reduce_dtype)
    if par.float8_fsdp_all_gather:  # the FP8 linears' weights gathered at one byte each
        for (unit, name), numel in layout.tensors:
            if unit in layout.units and unit != ROOT and is_fp8_weight(name, layout.grad_ops[(unit, name)]):
                fsdp.fp8[unit] = fsdp.fp8.get(unit, 0) + numel
    return fsdp


def copy_op(b: ProgramBuilder, ctx: Ctx, local: str, nbytes: float, deps: list[Idx],
            out_bytes: int | None = None) -> int:
    """FSDP2's copy of ``nbytes`` (at the model's dtype) on the compute stream: one kernel
    that reads them once and writes them once, at ``out_bytes`` per element when it casts
    (None: the model's dtype); no FLOPs (the fast estimate times the same op,
    twin.search.fsdpwalk.copy_s)."""
    written = 1.0 if out_bytes is None else out_bytes / b.e
    return b.elementwise(ctx, local, max(1, round(nbytes / b.e)), deps, tensors=1.0 + written,
                         flops_per_element=0.0, one_kernel=True)


class FSDP(Pass):
    """Tracks which units are gathered on this rank and emits their collectives."""

    def __init__(self, out: ProgramBuilder, group: tuple[int, ...], unit_numel: dict[int, int], *,
                 reshard: bool, every_mb: bool, last_mb: int, one_chunk: bool,
                 replicate: tuple[int, ...] = (), role: str = "dp", reduce_dtype: str = "fp32"):
        self.b = out
        self.reduce_dtype = reduce_dtype
        self.reduce_bytes = DTYPE_BYTES[reduce_dtype]  # per gradient element reduced
        self.group = group
        self.replicate = replicate  # HSDP: the replicas that all-reduce each reduced shard
        self.role = role  # the group's name: dp, dp_shard (HSDP) or dp-cp (CP)
        self.units = unit_numel  # unit key (layer or ROOT) -> TP-local parameter count
        self.reshard = reshard
        self.every_mb = every_mb
        self.last_mb = last_mb
        self.one_chunk = one_chunk  # the head and the embedding on this stage, one chunk
        self.gathered: dict[int, int] = {}  # unit -> its all-gather op
        self.grad_open: dict[int, int] = {}  # unit -> micro-batch count accumulated unsharded
        self.issued: list[int] = []
        self._tags: dict[int, str] = {}  # unit -> name of its gathered buffer
        self._copied: dict[int, Idx] = {}  # unit -> its copy-out, once emitted (per gather)
        self._head_grads: list[Idx] = []  # the head's grad ops of the latest backward
        self.fp8: dict[int, int] = {}  # unit -> elements gathered in FP8 (one byte each)

    # -- as a pass -------------------------------------------------------------------
    def before(self, unit: Unit) -> None:
        """Gather the unit (prefetching the next layer; the head does not prefetch in
        backward); before the head's or a layer's backward, open its unsharded gradient."""
        u = unit.key if unit.kind == LAYER else ROOT
        prefetch = None if unit.kind == HEAD_UNIT else unit.next_layer
        unit.deps.append(self.copy_out(unit.ctx, u, self.gather(unit.ctx, u, prefetch)))
        if unit.backward and unit.kind != EMBED:
            self.begin_backward(unit.ctx, u)

    def after(self, unit: Unit) -> None:
        """Forward: reshard a layer. Backward: reduce-scatter the unit's gradients; the
        root's wait for the head's and the embedding's when one chunk holds both."""
        ctx, out = unit.ctx, unit.out
        if not unit.backward:
            self.after_forward(ctx, unit.key if unit.kind == LAYER else ROOT, out)
        elif unit.kind == LAYER:
            self.after_backward(ctx, unit.key, list(unit.grads.values()), out)
        elif unit.kind == HEAD_UNIT:
            self._head_grads = list(unit.grads.values())
            if not self.one_chunk:
                self.after_backward(ctx, ROOT, self._head_grads, out)
        else:  # the embedding: the root's gradient is opened once it exists on this stage
            self.begin_backward(ctx, ROOT)
            head = self._head_grads if self.one_chunk else []
            self.after_backward(ctx, ROOT, list(unit.grads.values()) + head, out)

    def grads_reduced(self) -> list[Idx]:
        return self.issued

    # -- the units -------------------------------------------------------------------
    def _bytes(self, unit: int) -> float:
        return self.units[unit] * self.b.e

    def _gathered_bytes(self, unit: int) -> float:
        """What the unit's all-gather moves: FP8 weights at one byte (float8_fsdp_all_gather)."""
        fp8 = self.fp8.get(unit, 0)
        return (self.units[unit] - fp8) * self.b.e + fp8

    def _gather(self, ctx: Ctx, unit: int) -> int:
        c = ctx.at(layer=-1 if unit == ROOT else unit, paradigm="fsdp")
        tag = f"{'root' if unit == ROOT else unit}.{ctx.phase}.mb{ctx.mb}"
        self.b.alloc(c, f"gathered.{tag}", "buffers", self._gathered_bytes(unit),
                     [self.b.last_compute])
        idx = self.b.collective(c, f"{'root.' if unit == ROOT else ''}param.ag", "all_gather",
                                self.group, self.role, self._gathered_bytes(unit), [self.b.last_compute],
                                stream="comm.ag")
        self.gathered[unit] = idx
        self._tags[unit] = tag
        self._copied.pop(unit, None)
        return idx

    def copy_out(self, ctx: Ctx, unit: int, ag: Idx) -> Idx:
        """The unit's parameters copied out of its all-gather's output, on the compute stream,
        once per gather (returns the op the unit's compute waits for)."""
        if ag is None:
            return ag
        done = self._copied.get(unit)
        if done is None:
            c = ctx.at(layer=-1 if unit == ROOT else unit, paradigm="fsdp")
            done = self._copied[unit] = copy_op(
                self.b, c, f"{'root.' if unit == ROOT else ''}param.copy_out", self._gathered_bytes(unit),
                [ag])
        return done

    def _reduced_bytes(self, unit: int) -> float:
        """What the unit's reduce-scatter moves: its gradients at the reduce dtype."""
        return self.units[unit] * self.reduce_bytes

    def gather(self, ctx: Ctx, unit: int, prefetch: int | None) -> Idx:
        """Make ``unit`` gathered (returns the op to wait for); prefetch the next unit."""
        # (membership, not the op: over a one-rank shard group the gather is no op, None)
        ag = self.gathered[unit] if unit in self.gathered else self._gather(ctx, unit)
        if prefetch is not None and prefetch not in self.gathered:
            self._gather(ctx, prefetch)
        return ag

    def _release(self, ctx: Ctx, unit: int, after: Idx) -> None:
        tag = self._tags[unit]
        c = ctx.at(layer=-1 if unit == ROOT else unit, paradigm="fsdp")
        self.b.free(c, f"gathered.{tag}", "buffers", self._gathered_bytes(unit), [after])
        del self.gathered[unit]

    def after_forward(self, ctx: Ctx, unit: int, done: Idx) -> None:
        """Free the unit's gathered parameters when resharding after forward (not the root)."""
        if self.reshard and unit != ROOT:
            self._release(ctx, unit, done)

    def _grad_buffer(self, unit: int, opened: int) -> str:
        """The unsharded gradient's buffer: the micro-batch's when reduced every micro-batch;
        else the step's, named by no micro-batch (a micro-batch token in a name moves with
        the op when a fast-forwarded step repeats it: twin/sim/fastforward.py)."""
        return f"grad.{unit}.mb{opened}" if self.every_mb else f"grad.{unit}"

    def begin_backward(self, ctx: Ctx, unit: int) -> None:
        """Allocate the unit's unsharded gradient (kept across micro-batches without sync)."""
        if unit not in self.grad_open:
            c = ctx.at(layer=-1 if unit == ROOT else unit, paradigm="fsdp")
            self.b.alloc(c, self._grad_buffer(unit, ctx.mb), "grads", self._bytes(unit))
            self.grad_open[unit] = ctx.mb

    def after_backward(self, ctx: Ctx, unit: int, grad_ops: list[Idx], done: Idx) -> None:
        """Reduce-scatter the unit's gradients (this micro-batch or the last) and reshard."""
        c = ctx.at(layer=-1 if unit == ROOT else unit, paradigm="fsdp")
        if self.every_mb or ctx.mb == self.last_mb:
            prefix = "root." if unit == ROOT else ""
            copy_in = copy_op(self.b, c, f"{prefix}grad.copy_in", self._bytes(unit), grad_ops,
                              self.reduce_bytes)
            rs = self.b.collective(c, f"{prefix}grad.rs", "reduce_scatter", self.group,
                                   self.role, self._reduced_bytes(unit), [copy_in],
                                   stream="comm", dtype=self.reduce_dtype)
            reduced = copy_in if rs is None else rs  # (a shard group of one: no scatter)
            self.issued.append(rs)
            if len(self.replicate) > 1:  # FSDP2's all_reduce_stream: the shard across replicas
                self.issued.append(self.b.collective(
                    c, f"{prefix}grad.ar", "all_reduce", self.replicate,
                    "dp_replicate", self._reduced_bytes(unit) / len(self.group), [reduced],
                    stream="comm.ar", dtype=self.reduce_dtype))
            opened = self.grad_open.pop(unit)
            self.b.free(c, self._grad_buffer(unit, opened), "grads", self._bytes(unit), [reduced])
        self._release(ctx, unit, done)
