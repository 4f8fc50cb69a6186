"""Activation checkpointing as torchtitan applies it, for ``parallel.recompute=op`` and
``recompute=full`` with ``recompute_early_stop``.

torchtitan's op-level selective AC (``activation_checkpoint.mode=selective``,
``selective_ac_option=op``) checkpoints each transformer block with the non-reentrant
``torch.utils.checkpoint`` and a selective-checkpoint policy: the outputs of the ops in its
save list are kept (matmuls, the fused attention, TP's reduce-scatters), except every second
matmul of the block's forward, and everything else is recomputed in backward, as far as
backward needs (checkpoint's early stop). The policy counts matmuls per checkpointed call (a
fresh count each forward and each recomputation). On CPU, SDPA runs as
``_scaled_dot_product_flash_attention_for_cpu``, kept as its CUDA variants are.

Its full AC checkpoints each block with no policy: everything is recomputed, but the
non-reentrant checkpoint stops early too, so the block's last GEMM and its TP reduction are
not re-run (the twin's ``recompute_early_stop``; Megatron recomputes the whole layer).

This is what the twin schedules (twin.schedule.tensor.TensorParallel.op_recompute and
layer_forward's early stop), and conformance holds the collectives each recomputation issues
against them: op-level SAC under SP the two all-gathers again, under plain TP the first
all-reduce; full AC the forward's but the last reduction.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn


def _save_list() -> set:
    ops = torch.ops
    names = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    keep = {ops.aten.mm.default, ops._c10d_functional.reduce_scatter_tensor.default}
    keep |= {getattr(ops.aten, n).default for n in names if hasattr(ops.aten, n)}
    return keep


def _policy(saved: set, counts: dict):
    """The selective-checkpoint policy of one checkpointed call (``counts``: its matmuls so
    far, per forward and recomputation)."""
    from torch.utils.checkpoint import CheckpointPolicy

    mm = torch.ops.aten.mm.default

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == mm:
            counts[mode] = counts.get(mode, 0) + 1
            if counts[mode] % 2 == 0:  # every second matmul is recomputed
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def op_sac() -> Callable:
    """``checkpoint(fn, x)`` under torchtitan's op-level policy."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    saved = _save_list()

    def context():
        return create_selective_checkpoint_contexts(_policy(saved, {}))

    return partial(checkpoint, use_reentrant=False, context_fn=context, preserve_rng_state=False)


def full_ac() -> Callable:
    """``checkpoint(fn, x)`` as torchtitan's full AC runs it (its checkpoint wrapper's
    default: non-reentrant, which stops recomputing once backward has what it needs)."""
    from torch.utils.checkpoint import checkpoint

    return partial(checkpoint, use_reentrant=False, preserve_rng_state=False)


def apply_ac(model: nn.Module, recompute: str) -> None:
    """Checkpoint every transformer block of ``model`` as ``recompute`` says (``op``, or
    ``full`` with early stop; ``none`` leaves them alone)."""
    if recompute == "none":
        return
    if recompute not in ("op", "full"):
        raise ValueError(f"conformance checkpoints recompute=op or full, not {recompute!r}")
    for layer in model.layers.values():
        layer.checkpoint = op_sac() if recompute == "op" else full_ac()
