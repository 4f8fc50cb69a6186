"""Parameter counts per layer, per pipeline stage and per rank (TP-sharded, GQA-aware).

Megatron sharding (Shoeybi et al. 2019, §3): QKV and FC1 (and SwiGLU's gate) are
column-parallel (output features split by t), out-projection and FC2 row-parallel
(input features split by t; their biases replicated), norms replicated, word
embedding and LM head vocab-parallel (V/t rows each), learned positions replicated.
GQA under TP (mission seed 004): with kv < t KV heads, each rank holds one KV head
and every KV head is replicated on t/kv ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from twin.spec import Job, ModelSpec


def kv_heads_per_rank(model: ModelSpec, tp: int) -> int:
    """KV heads a TP rank holds: kv/t when t divides kv, else 1 (replicated)."""
    return model.num_kv_heads // tp if model.num_kv_heads >= tp else 1


def kv_replicas(model: ModelSpec, tp: int) -> int:
    """Copies of each KV head across the TP group: t/kv when kv < t, else 1."""
    return tp // model.num_kv_heads if model.num_kv_heads < tp else 1


@dataclass(frozen=True)
class LayerParams:
    """Parameters of one transformer layer held by one TP rank."""

    attention: int
    mlp: int
    norms: int

    @property
    def total(self) -> int:
        return self.attention + self.mlp + self.norms


def layer_params(model: ModelSpec, tp: int = 1) -> LayerParams:
    """One layer's parameters on one TP rank.

    Weights: Q h*(a*d)/t, K and V h*(kv_local*d) each, O (a*d)/t*h, MLP
    (2 or 3)*h*f/t. Biases (GPT style): QKV and FC1 split, O and FC2 replicated.
    With t=1, kv=a, f=4h, biases and LayerNorm: 12h^2 + 13h (Narayanan et al. 2021, Eq. 2).
    """
    h, d, f = model.hidden_size, model.head_dim, model.ffn_hidden_size
    q_out = model.num_heads // tp * d
    kv_out = kv_heads_per_rank(model, tp) * d
    attn = h * (q_out + 2 * kv_out) + q_out * h
    mlp = model.mlp_matrices * h * (f // tp)
    if model.bias:
        attn += q_out + 2 * kv_out + h
        mlp += (model.mlp_matrices - 1) * (f // tp) + h
    norms = 2 * norm_params(model)
    return LayerParams(attention=attn, mlp=mlp, norms=norms)


def norm_params(model: ModelSpec) -> int:
    """One norm: 2h for LayerNorm (scale and shift), h for RMSNorm."""
    return (2 if model.norm == "layernorm" else 1) * model.hidden_size


def vocab_rows(model: ModelSpec, tp: int) -> int:
    """Rows of the vocab-parallel embedding / LM head on one TP rank: ceil(V/t)."""
    return -(-model.vocab_size // tp)


def embedding_params(model: ModelSpec, tp: int = 1) -> int:
    """Input side on one TP rank: word embedding V/t * h, plus learned positions s*h."""
    n = vocab_rows(model, tp) * model.hidden_size
    if model.position_embedding == "learned":
        n += model.seq_len * model.hidden_size
    return n


def head_params(model: ModelSpec, tp: int = 1, *, holds_copy: bool = False) -> int:
    """Output side on one TP rank: final norm, plus the LM head V/t * h unless tied.

    ``holds_copy``: a tied head on a last pipeline stage that is not the first keeps its
    own copy of the word embedding (Megatron; gradients all-reduced with stage 0).
    """
    n = norm_params(model)
    if not model.tie_embeddings or holds_copy:
        n += vocab_rows(model, tp) * model.hidden_size
    return n


def model_params(model: ModelSpec) -> int:
    """Unique parameters of the whole model."""
    return (model.num_layers * layer_params(model).total + embedding_params(model)
            + head_params(model))


def stage_params(job: Job, stage: int) -> int:
    """Parameters on one rank of pipeline stage ``stage`` (TP-sharded, not DP-sharded)."""
    model, tp, pp = job.model, job.parallel.tp, job.parallel.pp
    n = len(job.layers_on_stage(stage)) * layer_params(model, tp).total
    if stage == 0:
        n += embedding_params(model, tp)
    if stage == pp - 1:
        n += head_params(model, tp, holds_copy=pp > 1 and model.tie_embeddings)
    return n
