"""The time of one unit's forward or backward (a layer, the embedding, the head), from the
schedule's own ops.

Each unit is emitted by the planner's tensor-parallel pass (``twin.schedule.tensor``: the
same GEMM shapes, attention, elementwise bytes and TP/SP collectives the twin simulates,
recomputation included), then timed as the engine runs one rank's streams when nothing
else is in flight: an op starts when its stream is free and its dependencies are done
(list scheduling over the IR's streams); compute takes ``CostModel.compute_time``,
a TP collective its closed form (``twin.search.comm``). The host's issue time is summed
apart (``CostModel.host_time``): a unit takes max(device, host) once the host runs ahead.

As the step builds them (``twin.schedule.step``): under CP the token-proportional ops see
s/cp tokens and the attention core is CP's (ring send/recv beside the kernels, all-gather or
Ulysses all-to-alls); a MoE layer's MLP is the expert block (router, dispatch and combine
all-to-alls over EP, ETP gathers, grouped GEMMs on the tokens rank 0 receives, shared
experts). Layers that emit alike share one timing (``layer_classes``: the dense layers,
and the MoE layers of one traffic). A send/recv pair completes c = a + S b after both ends
are posted (``CommModel.shift``; by symmetry the peer posts its send when this rank posts
its own of the same tag), transfers in one direction one after another; p2p ops hold no
stream (the IR's isend/irecv). ``w_s``: the weight-gradient GEMMs of a backward (W of the
split-backward schedules; I = B - W).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from twin.cost import CostModel
from twin.schedule.context import apply_cp
from twin.schedule.emit import Ctx, ProgramBuilder
from twin.schedule.ir import Op
from twin.schedule.moe import apply_moe
from twin.schedule.passes import LAYER, Unit
from twin.schedule.recompute import Recompute
from twin.schedule.tensor import TensorParallel
from twin.search.comm import CommModel
from twin.spec import Job, ParallelPlan
from twin.spec.experts import expert_grid
from twin.workload.context import local_model
from twin.workload.moe import traffic

UNITS = ("layer_fwd", "layer_bwd", "embed_fwd", "embed_bwd", "head_fwd", "head_bwd")


@dataclass(frozen=True)
class Timing:
    """One unit's forward or backward on one rank, one micro-batch."""

    device_s: float
    """Its critical path on the device: compute plus the TP communication it waits for."""
    compute_s: float
    """Its compute ops alone."""
    host_s: float
    """The host's time to issue its ops."""
    first_host_s: float
    """The host's time to issue its first op (the device's wait after a host sync)."""
    ops: int
    intra_s: float = 0.0
    """Its collectives' load on the links inside a node (``twin.search.comm.Split``)."""
    inter_s: float = 0.0
    """Its collectives' load on the network."""
    w_s: float = 0.0
    """Its weight-gradient GEMMs (a backward's W)."""

    @property
    def time_s(self) -> float:
        """The unit once the host runs ahead of the device: max(device, host)."""
        return max(self.device_s, self.host_s)

    @property
    def exposed_comm_s(self) -> float:
        return self.device_s - self.compute_s


def layer_classes(job: Job) -> dict[int, int]:
    """Each layer's representative: the first layer that emits the same ops (a dense
    model's layer 0; a MoE model's first dense layer, and per distinct traffic of rank 0
    the first MoE layer that routes so)."""
    moe, par = job.model.moe, job.parallel
    if moe is None:
        return dict.fromkeys(range(job.model.num_layers), 0)
    ep_rank = expert_grid(job.grid, par).coords(0)["ep"] if par.ep > 1 else 0
    tokens = par.micro_batch_size * job.model.seq_len // (par.tp if par.sp else 1)
    seen: dict[object, int] = {}
    out = {}
    for layer in range(job.model.num_layers):
        key = traffic(moe, layer, tokens, par.ep, ep_rank) if moe.is_moe_layer(layer) else None
        out[layer] = seen.setdefault(key, layer)
    return out


NOT_READ_BY_UNITS = frozenset({
    "dp", "pp", "zero_stage", "dp_replicate", "dp_shard", "fsdp_reshard_after_forward",
    "fsdp_reduce_dtype", "global_batch_size", "pp_schedule", "pp_schedule_csv",
    "pp_virtual_stages", "pp_stage_layers", "ddp_bucket_MB", "rank_order", "legacy_dp",
    "grad_sync", "optimizer_kernels", "float8_fsdp_all_gather"})
"""Plan fields ``unit_ops`` never reads (the grid's groups it reads are keyed apart:
``CommModel.split``); every other field, a new one too, keys its cache (``unit_plan_key``)."""
_UNIT_FIELDS = tuple(f.name for f in fields(ParallelPlan) if f.name not in NOT_READ_BY_UNITS)


def unit_plan_key(par: ParallelPlan) -> tuple:
    """What of a plan the units' ops depend on (the Estimator's unit cache key)."""
    return tuple(getattr(par, f) for f in _UNIT_FIELDS)


def unit_ops(job: Job) -> dict[str, list[Op]]:
    """The ops of each unit of ``UNITS`` on rank 0, as the planner emits them (recomputation
    of the layer's forward or attention core inside the layer's backward); ``layer_fwd@L``
    and ``layer_bwd@L`` for each representative L of ``layer_classes`` (``layer_fwd`` and
    ``layer_bwd``: layer 0's)."""
    par = job.parallel
    model = local_model(job.model, par)  # under CP the passes see the s/cp tokens a rank holds
    group = job.grid.group(0, "tp")
    out: dict[str, list[Op]] = {}

    def emit(name: str, body) -> None:
        b = ProgramBuilder(job, 0)
        tp = TensorParallel(b, model, par, group, [])
        tp.moe = apply_moe(b, job, 0, tp)
        tp.cp = apply_cp(b, job, 0)
        body(tp)
        out[name] = b.ops

    def layer_bwd(tp: TensorParallel, layer: int) -> None:
        unit = Unit(LAYER, layer, Ctx("bwd", mb=0, layer=layer))
        Recompute(tp.b, model, par, tp).before(unit)  # the step's recomputation, as it places it
        tp.run(unit)

    classes = layer_classes(job)
    for rep in sorted(set(classes.values())):
        emit(f"layer_fwd@{rep}", lambda tp, r=rep: tp.layer_forward(Ctx("fwd", mb=0, layer=r),
                                                                     None))
        emit(f"layer_bwd@{rep}", lambda tp, r=rep: layer_bwd(tp, r))
    out["layer_fwd"], out["layer_bwd"] = out[f"layer_fwd@{classes[0]}"], \
        out[f"layer_bwd@{classes[0]}"]
    emit("embed_fwd", lambda tp: tp.embedding_forward(Ctx("fwd", mb=0), None))
    emit("embed_bwd", lambda tp: tp.embedding_backward(Ctx("bwd", mb=0), None, {}))
    emit("head_fwd", lambda tp: tp.head_forward(Ctx("fwd", mb=0), None))
    emit("head_bwd", lambda tp: tp.head_backward(Ctx("bwd", mb=0), None, {}))
    return out


def time_ops(ops: list[Op], job: Job, cost: CostModel, comm: CommModel) -> Timing:
    """List-schedule ``ops`` over their streams (see the module docstring)."""
    gpu = job.cluster.gpu
    end = [0.0] * len(ops)
    free: dict[str, float] = {}
    sends: dict[str, tuple[int, float]] = {}  # tag -> (index, posted at)
    link = 0.0  # when the ring's outgoing link is free
    compute = host = intra = inter = w = 0.0
    first = None
    for i, op in enumerate(ops):
        ready = max((end[d] for d in op.deps), default=0.0)
        if op.stream == "mem":
            end[i] = ready
            continue
        h = cost.host_time(op)
        host += h
        first = h if first is None else first
        if op.is_p2p:
            if op.kind == "send":
                sends[op.tag] = (i, ready)
                end[i] = ready
                continue
            j, posted = sends.pop(op.tag, (None, ready))
            a, b = comm.shift(job, op.group_name or "cp")
            start = max(ready, posted, link)
            link = end[i] = start + a + b * op.bytes
            if j is not None:
                end[j] = end[i]
            continue
        if op.is_compute:
            dur = cost.compute_time(op, gpu)
            compute += dur
            if "wgrad" in op.name:
                w += dur
        elif op.is_collective:
            a, bi, be = comm.split(job, op.kind, op.group_name)
            dur = a + (bi + be) * op.bytes
            intra += bi * op.bytes
            inter += be * op.bytes
        else:
            dur = 0.0
        start = max(ready, free.get(op.stream, 0.0))
        end[i] = start + dur
        free[op.stream] = end[i]
    return Timing(max(end, default=0.0), compute, host, first or 0.0, len(ops), intra, inter, w)


def unit_timings(job: Job, cost: CostModel, comm: CommModel) -> dict[str, Timing]:
    """``time_ops`` of every unit of ``unit_ops``."""
    return {name: time_ops(ops, job, cost, comm) for name, ops in unit_ops(job).items()}
