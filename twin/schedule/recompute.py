"""Activation memory and recomputation (activation checkpointing): what each unit keeps for backward.

Forward, every unit allocates the activations it keeps for its backward: a layer the
bytes of ``activation_bytes_per_layer`` under the plan's ``recompute`` policy
(Korthikanti et al. 2022, Table 2), the head its input and fp32 logits, the embedding its
dropout mask (when the model has dropout). Backward frees them once the unit's backward
is done. ``recompute=full`` keeps only a layer's input and runs the whole layer forward
again (with ``recompute_early_stop``, up to fc2's input, where PyTorch's non-reentrant
checkpoint stops), in its own ``recompute`` phase, just before the layer's backward (its
activations allocated for that while; PyTorch's non-reentrant checkpoint, as op-level SAC
and early stop model it, once the backward has taken the output gradient's residual and
gather); ``recompute=selective`` re-runs only the attention core
(Korthikanti §5); ``recompute=op`` (torchtitan's op-level SAC) keeps every other matmul's
output and the attention's, and re-runs the rest of the layer up to what its backward needs
(TensorParallel.op_recompute), holding the difference to the kept bytes of ``none``.
"""

from __future__ import annotations

from functools import partial

from twin.schedule.emit import Idx, ProgramBuilder
from twin.schedule.passes import EMBED, LAYER, Pass, Unit
from twin.schedule.tensor import TensorParallel
from twin.spec import ModelSpec, ParallelPlan
from twin.workload.loss import saved_logits_bytes
from twin.workload.memory import activation_bytes_per_layer


def layer_activation_bytes(model: ModelSpec, par: ParallelPlan, recompute: str) -> float:
    """Bytes one layer keeps for backward on one micro-batch under ``recompute``."""
    return activation_bytes_per_layer(model, par.micro_batch_size, par.tp, par.sp, recompute,
                                      par.flash_attention)


def head_activation_bytes(model: ModelSpec, par: ParallelPlan, elem_bytes: int) -> float:
    """The head's kept activations: 2 * e * s*b*h / (t under SP) (final norm's and the head's
    inputs) + what the loss keeps (``saved_logits_bytes``: the fp32 log-softmax, 4 * s*b *
    vocab/t; compiled, the logits and their log-sum-exp)."""
    sb = model.seq_len * par.micro_batch_size
    sp_div = par.tp if par.sp else 1
    return 2 * elem_bytes * sb * model.hidden_size / sp_div \
        + saved_logits_bytes(model, par, par.micro_batch_size)


def embedding_dropout_bytes(model: ModelSpec, par: ParallelPlan) -> float:
    """The embedding's dropout mask: one byte per element of s*b*h (/t under SP)."""
    sp_div = par.tp if par.sp else 1
    return model.seq_len * par.micro_batch_size * model.hidden_size / sp_div


def apply_ac(out: ProgramBuilder, model: ModelSpec, par: ParallelPlan,
             tp: TensorParallel) -> Recompute:
    """Activation memory of every unit, and the recomputation ``par.recompute`` asks for
    (re-running ``tp``'s layer or attention core)."""
    return Recompute(out, model, par, tp)


class Recompute(Pass):
    """Allocates and frees the kept activations; re-runs forward work before a backward."""

    def __init__(self, out: ProgramBuilder, model: ModelSpec, par: ParallelPlan,
                 tp: TensorParallel):
        self.b, self.tp = out, tp
        self.policy = par.recompute
        self.early_stop = par.recompute_early_stop
        # PyTorch's non-reentrant checkpoint (op-level SAC, full with early stop) recomputes
        # when backward first unpacks a saved tensor: fc2's backward, after the output
        # gradient's residual and (SP) gather; Megatron's at the start of the layer's backward.
        # (Async TP fuses that gather with fc2's GEMM: recomputed before it.)
        self.lazy = par.recompute == "op" or par.recompute_early_stop
        self.dropout = bool(model.dropout)
        self.layer_bytes = layer_activation_bytes(model, par, par.recompute)
        self.full_layer_bytes = layer_activation_bytes(model, par, "none")
        self.head_bytes = head_activation_bytes(model, par, out.e)
        self.embed_bytes = embedding_dropout_bytes(model, par)

    def _moe(self, layer: int, policy: str) -> float:
        """A MoE layer's routed activations beyond a dense layer's (0 for a dense model)."""
        return 0.0 if self.tp.moe is None else self.tp.moe.activation_delta(layer, policy)

    def _buffer(self, unit: Unit) -> tuple[str, float] | None:
        """The unit's kept activations: (buffer name, bytes), or None."""
        mb = unit.ctx.mb
        if unit.kind == LAYER:
            return f"act.L{unit.key}.mb{mb}", self.layer_bytes + self._moe(unit.key, self.policy)
        if unit.kind == EMBED:
            return (f"act.embed.mb{mb}", self.embed_bytes) if self.dropout else None
        return f"act.head.mb{mb}", self.head_bytes

    def before(self, unit: Unit) -> None:
        """Forward: allocate the kept activations. Backward of a layer: recompute."""
        if not unit.backward:
            buf = self._buffer(unit)
            if buf:
                self.b.alloc(unit.ctx, buf[0], "activations", buf[1])
            return
        if unit.kind != LAYER or self.policy == "none":
            return
        rctx = unit.ctx.at(phase="recompute")
        if self.policy in ("full", "op"):
            self.b.alloc(rctx, f"ract.L{unit.key}.mb{rctx.mb}", "activations",
                         self._recomputed_bytes(unit))
            redo = partial(self._redo, rctx, [unit.x, unit.deps])
            moe = self.tp.moe is not None and self.tp.moe.is_moe(unit.key)
            if self.lazy and self.tp.async_tp is None and not moe:  # where backward first
                unit.recompute = redo  # unpacks one (a MoE layer's: right after resid2.bwd)
            else:
                unit.x = redo()
        elif self.policy == "selective":
            unit.recompute_attention = self.tp.attention_recompute(rctx, [unit.x, unit.deps])

    def action_key(self, mb: int) -> tuple:
        """Its ops depend on the micro-batch by their labels alone."""
        return ()

    def _redo(self, rctx, deps) -> Idx:
        """The layer's recomputation under ``rctx`` from ``deps``."""
        if self.policy == "full":
            return self.tp.layer_forward(rctx, deps, early_stop=self.early_stop)
        return self.tp.op_recompute(rctx, deps)

    def after(self, unit: Unit) -> None:
        """Backward: free the kept activations (and a full recomputation's)."""
        if not unit.backward:
            return
        buf = self._buffer(unit)
        if buf:
            self.b.free(unit.ctx, buf[0], "activations", buf[1], [unit.out])
        if unit.kind == LAYER and self.policy in ("full", "op"):
            self.b.free(unit.ctx, f"ract.L{unit.key}.mb{unit.ctx.mb}", "activations",
                        self._recomputed_bytes(unit), [unit.out])

    def _recomputed_bytes(self, unit: Unit) -> float:
        """What a layer's recomputation holds until its backward is done: the whole layer's
        activations (full), or what recompute=none keeps beyond what op-level SAC kept."""
        if self.policy == "full":
            return self.full_layer_bytes + self._moe(unit.key, "none")
        return self.full_layer_bytes - self.layer_bytes
