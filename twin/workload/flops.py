"""FLOPs of each op of a transformer step, per TP rank, forward and backward.

Conventions (Narayanan et al. 2021, Appendix; Korthikanti et al. 2022, App. A):
a GEMM of (m x k) @ (k x n) costs 2mnk; attention scores and attention over V each
cost 2*b*a*s^2*d (full square, causal masking not halved, as in MFU reporting);
backward costs twice the forward. Per layer forward with MHA and f = 4h this gives
24*B*s*h^2 + 4*B*s^2*h, so a step costs 72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h))
(Korthikanti Eq. 7) without recompute and 96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h))
(Narayanan Eq. 3) with full recompute.
"""

from __future__ import annotations

from dataclasses import dataclass

from twin.spec import ModelSpec
from twin.workload.moe import moe_mlp_forward_flops
from twin.workload.params import kv_heads_per_rank, vocab_rows


@dataclass(frozen=True)
class Gemm:
    """A matrix multiply (m x k) @ (k x n) of one forward pass."""

    name: str
    m: int
    n: int
    k: int

    @property
    def flops(self) -> int:
        """2mnk."""
        return 2 * self.m * self.n * self.k


def layer_gemms(model: ModelSpec, tokens: int, tp: int = 1) -> list[Gemm]:
    """The GEMMs of one layer's forward on one TP rank, in execution order.

    QKV (column-parallel, GQA: kv_local heads), out-projection (row-parallel),
    MLP: fc1 (+ gate for SwiGLU) column-parallel, fc2 row-parallel.
    """
    h, d, f = model.hidden_size, model.head_dim, model.ffn_hidden_size
    q = model.num_heads // tp * d
    kv = kv_heads_per_rank(model, tp) * d
    gemms = [Gemm("qkv", tokens, q + 2 * kv, h), Gemm("out_proj", tokens, h, q)]
    if model.activation == "swiglu":
        gemms += [Gemm("fc_gate", tokens, f // tp, h), Gemm("fc_up", tokens, f // tp, h)]
    else:
        gemms += [Gemm("fc1", tokens, f // tp, h)]
    gemms.append(Gemm("fc2", tokens, h, f // tp))
    return gemms


def attention_core_flops(model: ModelSpec, batch: int, tp: int = 1) -> int:
    """Scores QK^T plus attention over V, forward, one TP rank: 4*b*(a/t)*s^2*d."""
    return 4 * batch * (model.num_heads // tp) * model.seq_len ** 2 * model.head_dim


def layer_forward_flops(model: ModelSpec, batch: int, tp: int = 1) -> int:
    """One layer's forward on one TP rank (GEMMs plus attention core)."""
    tokens = batch * model.seq_len
    return sum(g.flops for g in layer_gemms(model, tokens, tp)) + \
        attention_core_flops(model, batch, tp)


def lm_head_gemm(model: ModelSpec, tokens: int, tp: int = 1) -> Gemm:
    """The logit GEMM, vocab-parallel: (tokens x h) @ (h x V/t)."""
    return Gemm("lm_head", tokens, vocab_rows(model, tp), model.hidden_size)


def recompute_forward_flops(model: ModelSpec, batch: int, tp: int, recompute: str,
                            flash_attention: bool, early_stop: bool = False) -> int:
    """Extra forward FLOPs per layer redone in backward.

    full: the whole layer forward again (``early_stop``: without the down projection fc2,
    where torch.utils.checkpoint's non-reentrant recomputation stops); selective: the attention core again
    (Korthikanti §5); op (torchtitan's op-level SAC): the key, output and (SwiGLU) up
    projections (TensorParallel.op_recompute); flash attention without full or selective
    recomputes the scores in its backward (FlashAttention-2: 5 backward matmuls vs 2
    forward, so +0.5 core).
    """
    if recompute == "full":
        fc2 = 2 * batch * model.seq_len * model.ffn_hidden_size * model.hidden_size // tp
        return layer_forward_flops(model, batch, tp) - (fc2 if early_stop else 0)
    if recompute == "selective":
        return attention_core_flops(model, batch, tp)
    extra = 0
    if recompute == "op":
        h, q = model.hidden_size, model.num_heads * model.head_dim
        up = model.ffn_hidden_size if model.activation == "swiglu" else 0
        extra = 2 * batch * model.seq_len * h * (model.num_kv_heads * model.head_dim + q + up) // tp
    if flash_attention:
        return extra + attention_core_flops(model, batch, tp) // 2
    return extra


def model_flops_per_step(model: ModelSpec, global_batch: int) -> int:
    """Model FLOPs of one step over all GPUs: 3 x forward of every layer and the logits."""
    tokens = global_batch * model.seq_len
    fwd = model.num_layers * layer_forward_flops(model, global_batch) + \
        lm_head_gemm(model, tokens).flops
    if model.moe is not None:  # a MoE layer's MLP is its router and the experts a token visits
        dense_mlp = sum(g.flops for g in layer_gemms(model, tokens) if g.name.startswith("fc"))
        fwd += len(model.moe.moe_layers(model.num_layers)) * (
            moe_mlp_forward_flops(model, tokens) - dense_mlp)
    return 3 * fwd


def hardware_flops_per_step(model: ModelSpec, global_batch: int, recompute: str = "none",
                            flash_attention: bool = False) -> int:
    """FLOPs actually executed (model FLOPs plus recomputation), over all GPUs.

    Without TP replication; with full recompute and eager attention this is
    Narayanan Eq. 3.
    """
    extra = recompute_forward_flops(model, global_batch, 1, recompute, flash_attention)
    return model_flops_per_step(model, global_batch) + model.num_layers * extra
