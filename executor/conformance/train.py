"""One training step the way PyTorch users write it: forward, loss, backward, clip, AdamW.

The same recipe trains the single-process reference (no parallelism) and every rank of
a parallel run, so their losses can be compared. Gradients are clipped to a global norm
of 1 the way Megatron does it and the schedule models it: each rank sums the squares of
its gradient shards (a replica counted once), and one fp32 all-reduce over the
model-parallel group (tp-pp, plus dp under FSDP) completes the norm. (torch.nn.utils.
clip_grad_norm_ over DTensor gradients would instead all-reduce the vector of per-tensor
norms once per sharded mesh dimension; see compare.py's documented differences.)
"""

from __future__ import annotations

import contextlib
import math

import torch

from executor.conformance.model import loss_fn, make_batch
from twin.spec import Job

LR = 1e-2
MAX_NORM = 1.0
OPT_RANGE = "paratwin.opt"
"""record_function range around a step's end (partial-grad sync, clip, AdamW, zero_grad)."""


def optimizer(params) -> torch.optim.Optimizer:
    """AdamW without weight decay (so the reference and the shards agree to rounding)."""
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0)


def step_batch(job: Job, seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of one step: global_batch_size sequences, the same on every rank."""
    return make_batch(job.model, job.parallel.global_batch_size, seed * 1000 + step)


def replicate_partial_grads(params) -> int:
    """All-reduce, once each, the gradients DTensor left Partial (sequence-parallel norm weights:
    each TP rank saw only its sequence shard). Without this DTensor all-reduces them again at
    every use (the norm, the clip, each AdamW update). Returns how many there were."""
    from torch.distributed.tensor import DTensor, Replicate

    n = 0
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            p.grad = g.redistribute(placements=[Replicate() if pl.is_partial() else pl
                                                for pl in g.placements])
            n += 1
    return n


def counted_here(name: str, grad, coords: dict[str, int], tp_sharded: set[str]) -> bool:
    """Whether this rank adds ``grad``'s local squares to the global norm (Megatron's rule:
    a tensor replicated over a mesh dimension counts on that dimension's rank 0 only)."""
    from torch.distributed.tensor import DTensor

    if isinstance(grad, DTensor):
        dims = grad.device_mesh.mesh_dim_names or ()
        return all(coords.get(d, 0) == 0 for d, pl in zip(dims, grad.placements)
                   if pl.is_replicate())
    return name in tp_sharded or coords.get("tp", 0) == 0


def grad_norm(named_params, coords: dict[str, int], tp_sharded: set[str], group=None) -> torch.Tensor:
    """Global L2 norm of the gradients with one fp32 all-reduce over ``group`` (Megatron's
    clip_grad_norm: the squares of each rank's shards, replicas counted once)."""
    from torch.distributed.tensor import DTensor

    sq = torch.zeros((), dtype=torch.float32)
    for name, p in named_params:
        g = p.grad
        if g is None or not counted_here(name, g, coords, tp_sharded):
            continue
        local = g.to_local() if isinstance(g, DTensor) else g
        sq = sq + local.float().pow(2).sum()
    if group is not None:
        torch.distributed.all_reduce(sq, group=group)
    return sq.sqrt()


def clip(named_params, coords: dict[str, int] | None = None, tp_sharded: set[str] = frozenset(),
         group=None) -> float:
    """Scale gradients so their global norm is at most MAX_NORM; returns the norm."""
    from torch.distributed.tensor import DTensor

    named_params = [(n, p) for n, p in named_params if p.grad is not None]
    norm = grad_norm(named_params, coords or {}, tp_sharded, group)
    coef = torch.clamp(MAX_NORM / (norm + 1e-6), max=1.0)
    for _, p in named_params:
        g = p.grad
        (g.to_local() if isinstance(g, DTensor) else g).mul_(coef)
    return float(norm)


def loss_context(tp: int):
    """``loss_parallel`` under TP (the logits stay sharded over the vocabulary), else nothing."""
    if tp > 1:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return contextlib.nullcontext()


def local_value(loss) -> float:
    """A loss as a float (a replicated DTensor's local value)."""
    from torch.distributed.tensor import DTensor

    return float(loss.to_local() if isinstance(loss, DTensor) else loss)


def data_step(model, x: torch.Tensor, y: torch.Tensor, microbatches: int, tp: int,
              label=lambda phase: None) -> float:
    """Forward and backward over ``microbatches`` equal slices of (x, y); DDP syncs the last only.

    Each micro-batch's loss is scaled by 1/m so the gradients are those of the mean loss.
    Returns the mean loss.
    """
    total = 0.0
    xs, ys = x.chunk(microbatches), y.chunk(microbatches)
    for i in range(microbatches):
        sync = i == microbatches - 1 or not hasattr(model, "no_sync")
        with (contextlib.nullcontext() if sync else model.no_sync()), loss_context(tp):
            label("fwd")
            loss = loss_fn(model(xs[i]), ys[i]) / microbatches
            label("bwd")
            loss.backward()
        total += local_value(loss)
    return total


def reference_losses(job: Job, seed: int, steps: int) -> list[float]:
    """Losses of the single-process run: the whole global batch, one model, same recipe (a MoE
    model routes it in the ranks' blocks of b * s tokens: executor/conformance/moe.py)."""
    from executor.conformance.model import build_model
    from executor.conformance.moe import route_in_blocks, routed_tokens

    model = build_model(job.model, seed)
    route_in_blocks(model, routed_tokens(job))
    opt = optimizer(model.parameters())
    out = []
    for step in range(steps):
        x, y = step_batch(job, seed, step)
        loss = loss_fn(model(x), y)
        loss.backward()
        clip(model.named_parameters())
        opt.step()
        opt.zero_grad()
        out.append(float(loss.detach()))
    return out


def relative_error(a: float, b: float) -> float:
    """|a - b| / |b| (0 when both are 0)."""
    return 0.0 if a == b else abs(a - b) / max(abs(b), math.ulp(1.0))


# Profiled CPU time per op kind (the twin's kinds; "collectives" holds every collective and
# p2p, "framework" the self time of everything else: autograd engine, module hooks, Python).
PROFILE_KINDS = ("gemm", "attention", "elementwise", "optimizer", "collectives", "framework")
_GEMM = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::mv", "aten::addmv",
         "aten::matmul", "aten::linear", "aten::_addmm_activation", "aten::dot"}
_COMM = ("gloo:", "nccl:", "c10d::", "_c10d_functional::", "c10d_functional::",
         "record_param_comms")
_OPT = ("Optimizer.step#", "Optimizer.zero_grad#", OPT_RANGE)


def profiler():
    """torch.profiler over the CPU, no shapes or stacks (a few percent on a step)."""
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU], record_shapes=False, with_stack=False)


def op_kind(name: str, in_opt: bool) -> str:
    """The kind of a profiled event: collectives by name first (the clip's all-reduce stays a
    collective), then everything inside the step's end is the optimizer, then by aten name."""
    if name.startswith(_COMM):
        return "collectives"
    if in_opt:
        return "optimizer"
    if name in _GEMM:
        return "gemm"
    if "scaled_dot_product" in name or name in ("aten::_softmax", "aten::softmax",
                                                 "aten::_softmax_backward_data"):
        return "attention"
    if name.startswith("aten::"):
        return "elementwise"
    return "framework"


def classify_events(events) -> dict[str, float]:
    """Seconds of self CPU time per kind over profiler events (FunctionEvent-like: ``name``,
    ``self_cpu_time_total`` in us, ``cpu_parent``); an event inside an optimizer range counts
    as optimizer."""
    out = dict.fromkeys(PROFILE_KINDS, 0.0)
    opt_cache: dict[int, bool] = {}

    def in_opt(ev) -> bool:
        chain, hit = [], False
        while ev is not None:
            if id(ev) in opt_cache:
                hit = opt_cache[id(ev)]
                break
            chain.append(ev)
            if ev.name.startswith(_OPT):
                hit = True
                break
            ev = ev.cpu_parent
        for e in chain:
            opt_cache[id(e)] = hit
        return hit

    for ev in events:
        out[op_kind(ev.name, in_opt(ev))] += ev.self_cpu_time_total / 1e6
    return out


def profile_kinds(prof, step_s: float) -> dict:
    """The profiled step's CPU seconds per kind, plus ``unattributed``: the step's wall time no
    event covers (the main thread blocked, mostly waiting for collectives, which gloo runs on
    threads the profiler does not see), its wall time and its event count."""
    events = prof.events()
    kinds = classify_events(events)
    kinds["unattributed"] = max(0.0, step_s - sum(kinds.values()))
    return {"step_s": step_s, "kinds": kinds, "events": len(events)}
