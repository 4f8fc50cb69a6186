"""Activation checkpointing as torchtitan applies it, for ``parallel.recompute=op``.

torchtitan's op-level selective AC (``activation_checkpoint.mode=selective``,
``selective_ac_option=op``) checkpoints each transformer block with the non-reentrant
``torch.utils.checkpoint`` and a selective-checkpoint policy: the outputs of the ops in its
save list are kept (matmuls, the fused attention, TP's reduce-scatters), except every second
matmul of the block's forward, and everything else is recomputed in backward, as far as
backward needs (checkpoint's early stop). The policy counts matmuls per checkpointed call (a
fresh count each forward and each recomputation). On CPU, SDPA runs as
``_scaled_dot_product_flash_attention_for_cpu``, kept as its CUDA variants are.

This is what the twin's ``recompute=op`` schedules (twin.schedule.tensor.TensorParallel.
op_recompute), and conformance holds the collectives its recomputation issues against
them: under SP the two all-gathers again, under plain TP the first all-reduce.
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


def apply_ac(model: nn.Module, recompute: str) -> None:
    """Checkpoint every transformer block of ``model`` as ``recompute`` says (``op``; ``none``
    leaves them alone)."""
    if recompute == "none":
        return
    if recompute != "op":
        raise ValueError(f"conformance checkpoints recompute=op only, not {recompute!r}")
    for layer in model.layers.values():
        layer.checkpoint = op_sac()
