"""One training step the way PyTorch users write it: forward, loss, backward, clip, AdamW.

The same function trains the single-process reference (no parallelism) and every rank
of a parallel run, so their losses can be compared. Gradients are clipped to a global
norm of 1 (torchtitan's recipe: a DTensor norm is completed with ``full_tensor()``, and
pipeline stages add their squared norms with one all-reduce over the PP group).
"""

from __future__ import annotations

import contextlib
import math

import torch

from executor.conformance.model import loss_fn, make_batch
from twin.spec import Job

LR = 1e-2
MAX_NORM = 1.0


def optimizer(params) -> torch.optim.Optimizer:
    """AdamW without weight decay (so the reference and the shards agree to rounding)."""
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0)


def step_batch(job: Job, seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of one step: global_batch_size sequences, the same on every rank."""
    return make_batch(job.model, job.parallel.global_batch_size, seed * 1000 + step)


def grad_norm(params, pp_group=None) -> torch.Tensor:
    """Global L2 norm of the gradients: local, DTensor (``full_tensor``), then over PP stages."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    sq = torch.zeros(())
    dtensors = [g for g in grads if isinstance(g, DTensor)]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    if dtensors:
        sq = sq + torch.nn.utils.get_total_norm(dtensors).full_tensor() ** 2
    if plain:
        sq = sq + torch.nn.utils.get_total_norm(plain) ** 2
    if pp_group is not None:
        torch.distributed.all_reduce(sq, group=pp_group)
    return sq.sqrt()


def clip(params, pp_group=None) -> float:
    """Scale gradients so their global norm is at most MAX_NORM; returns the norm."""
    from torch.distributed.tensor import DTensor

    params = [p for p in params if p.grad is not None]
    norm = grad_norm(params, pp_group)
    for group in ([p for p in params if isinstance(p.grad, DTensor)],
                  [p for p in params if not isinstance(p.grad, DTensor)]):
        if group:  # foreach kernels take DTensors or plain tensors, not both at once
            torch.nn.utils.clip_grads_with_norm_(group, MAX_NORM, norm)
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
    """Losses of the single-process run: the whole global batch, one model, same recipe."""
    from executor.conformance.model import build_model

    model = build_model(job.model, seed)
    opt = optimizer(model.parameters())
    out = []
    for step in range(steps):
        x, y = step_batch(job, seed, step)
        loss = loss_fn(model(x), y)
        loss.backward()
        clip(model.parameters())
        opt.step()
        opt.zero_grad()
        out.append(float(loss))
    return out


def relative_error(a: float, b: float) -> float:
    """|a - b| / |b| (0 when both are 0)."""
    return 0.0 if a == b else abs(a - b) / max(abs(b), math.ulp(1.0))
