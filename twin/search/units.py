"""The time of one unit's forward or backward (a layer, the embedding, the head), from the
schedule's own ops.

Each unit is emitted by the planner's tensor-parallel pass (``twin.schedule.tensor``: the
same GEMM shapes, attention, elementwise bytes and TP/SP collectives the twin simulates,
recomputation included), then timed as the engine runs one rank's streams when nothing
else is in flight: an op starts when its stream is free and its dependencies are done
(list scheduling over the IR's streams); compute takes ``CostModel.compute_time``,
a TP collective its closed form (``twin.search.comm``). The host's issue time is summed
apart (``CostModel.host_time``): a unit takes max(device, host) once the host runs ahead.
"""

from __future__ import annotations

from dataclasses import dataclass

from twin.cost import CostModel
from twin.schedule.emit import Ctx, ProgramBuilder
from twin.schedule.ir import Op
from twin.schedule.tensor import TensorParallel
from twin.search.comm import CommModel
from twin.spec import Job

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

    @property
    def time_s(self) -> float:
        """The unit once the host runs ahead of the device: max(device, host)."""
        return max(self.device_s, self.host_s)

    @property
    def exposed_comm_s(self) -> float:
        return self.device_s - self.compute_s


def unit_ops(job: Job) -> dict[str, list[Op]]:
    """The ops of each unit of ``UNITS`` on rank 0, as the planner emits them (recomputation
    of the layer's forward or attention core inside the layer's backward)."""
    par, model = job.parallel, job.model
    group = job.grid.group(0, "tp")
    out: dict[str, list[Op]] = {}

    def emit(name: str, body) -> None:
        b = ProgramBuilder(job, 0)
        body(TensorParallel(b, model, par, group, []))
        out[name] = b.ops

    fwd, bwd = Ctx("fwd", mb=0, layer=0), Ctx("bwd", mb=0, layer=0)
    rec = Ctx("recompute", mb=0, layer=0)

    def layer_bwd(tp: TensorParallel) -> None:
        x, attn = None, None
        if par.recompute == "full":
            x = tp.layer_forward(rec, None)
        elif par.recompute == "selective":
            attn = tp.attention_recompute(rec, None)
        tp.layer_backward(bwd, x, {}, recompute_attention=attn)

    emit("layer_fwd", lambda tp: tp.layer_forward(fwd, None))
    emit("layer_bwd", layer_bwd)
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
    compute = host = intra = inter = 0.0
    first = None
    for i, op in enumerate(ops):
        ready = max((end[d] for d in op.deps), default=0.0)
        if op.stream == "mem":
            end[i] = ready
            continue
        h = cost.host_time(op)
        host += h
        first = h if first is None else first
        if op.is_compute:
            dur = cost.compute_time(op, gpu)
            compute += dur
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
    return Timing(max(end, default=0.0), compute, host, first or 0.0, len(ops), intra, inter)


def unit_timings(job: Job, cost: CostModel, comm: CommModel) -> dict[str, Timing]:
    """``time_ops`` of every unit of ``unit_ops``."""
    return {name: time_ops(ops, job, cost, comm) for name, ops in unit_ops(job).items()}
