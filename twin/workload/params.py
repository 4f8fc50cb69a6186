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
from functools import lru_cache
from typing import NamedTuple

from twin.spec import Job, ModelSpec, ParallelPlan


def kv_heads_per_rank(model: ModelSpec, tp: int) -> int:
    """KV heads a TP rank holds: kv/t when t divides kv, else 1 (replicated)."""
    return model.num_kv_heads // tp if model.num_kv_heads >= tp else 1


def kv_replicas(model: ModelSpec, tp: int) -> int:
    """Copies of each KV head across the TP group: t/kv when kv < t, else 1."""
    return tp // model.num_kv_heads if model.num_kv_heads < tp else 1


class Tensor(NamedTuple):
    """A parameter tensor on one TP rank: its name, size, block and the op producing its grad."""

    name: str
    numel: int
    block: str  # attention | mlp | norms | embedding | head
    grad_op: str  # local name of the backward op after which its gradient is ready


def layer_tensors(model: ModelSpec, tp: int = 1, layer: int | None = None) -> list[Tensor]:
    """One layer's parameter tensors on one TP rank, in registration order.

    Weights: Q h*(a*d)/t, K and V h*(kv_local*d) each, O (a*d)/t*h, MLP (2 or 3)
    matrices h*f/t. Biases (GPT style): QKV and FC1 split, O and FC2 replicated.
    With t=1, kv=a, f=4h, biases and LayerNorm: 12h^2 + 13h (Narayanan et al. 2021, Eq. 2).
    A MoE layer (``layer`` given and ``model.moe.is_moe_layer(layer)``) holds instead of the
    MLP its router (h x E, replicated over TP) and its shared experts as one TP-split MLP of
    s * f_e; its routed experts are ``expert_tensors`` (sharded by EP and ETP, not TP).
    """
    if model.moe is not None and layer is not None and model.moe.is_moe_layer(layer):
        return _moe_layer_tensors(model, tp)
    h, d, f = model.hidden_size, model.head_dim, model.ffn_hidden_size
    q = model.num_heads // tp * d
    kv = kv_heads_per_rank(model, tp) * d
    ft = f // tp
    b = model.bias

    def norm(n: str) -> list[Tensor]:
        ts = [Tensor(f"{n}.weight", h, "norms", f"{n}.bwd")]
        return ts + ([Tensor(f"{n}.bias", h, "norms", f"{n}.bwd")]
                     if model.norm == "layernorm" else [])

    def linear(n: str, fan_in: int, fan_out: int, block: str, op: str) -> list[Tensor]:
        ts = [Tensor(f"{n}.weight", fan_in * fan_out, block, f"{op}.wgrad")]
        return ts + ([Tensor(f"{n}.bias", fan_out, block, f"{op}.wgrad")] if b else [])

    ts = norm("norm1")
    ts += linear("wq", h, q, "attention", "qkv") + linear("wk", h, kv, "attention", "qkv")
    ts += linear("wv", h, kv, "attention", "qkv") + linear("wo", q, h, "attention", "out_proj")
    ts += norm("norm2")
    if model.activation == "swiglu":
        ts += linear("w_gate", h, ft, "mlp", "fc_gate") + linear("w_up", h, ft, "mlp", "fc_up")
    else:
        ts += linear("fc1", h, ft, "mlp", "fc1")
    ts += linear("fc2", ft, h, "mlp", "fc2")
    return ts


def _moe_layer_tensors(model: ModelSpec, tp: int) -> list[Tensor]:
    """A MoE layer on one TP rank: attention and norms as dense, the router, shared experts
    (one TP-split MLP of s * f_e: column-parallel gate/up or fc1, row-parallel fc2)."""
    moe = model.moe
    ts = [t for t in layer_tensors(model, tp) if t.block != "mlp"]
    ts.append(Tensor("router.weight", moe.num_experts * model.hidden_size, "mlp",
                     "router.wgrad"))
    if moe.shared_experts:
        h, fs, bias = model.hidden_size, moe.shared_ffn_hidden_size // tp, model.bias
        ins = ("fc_gate", "fc_up") if model.activation == "swiglu" else ("fc1",)
        for name, fan_in, fan_out in [(n, h, fs) for n in ins] + [("fc2", fs, h)]:
            ts.append(Tensor(f"shared.{name}.weight", fan_in * fan_out, "mlp",
                             f"shared.{name}.wgrad"))
            if bias:
                ts.append(Tensor(f"shared.{name}.bias", fan_out if name != "fc2" else h, "mlp",
                                 f"shared.{name}.wgrad"))
    return ts


def expert_tensors(model: ModelSpec, ep: int = 1, etp: int = 1) -> list[Tensor]:
    """One MoE layer's routed experts on one rank: E/ep experts, each's inner size split by
    etp, stacked per matrix as Megatron's grouped experts hold them: fc1 (E/ep, h, m f_e/etp)
    column-parallel (gate and up fused for SwiGLU: m = 2), fc2 (E/ep, f_e/etp, h)
    row-parallel (its bias, like a row-parallel bias, whole on every ETP rank)."""
    moe = model.moe
    n, h, fe = moe.num_experts // ep, model.hidden_size, moe.moe_ffn_hidden_size // etp
    m = 2 if model.activation == "swiglu" else 1
    ts = [Tensor("experts.fc1", n * h * m * fe, "experts", "experts.fc1.wgrad")]
    if model.bias:
        ts.append(Tensor("experts.fc1.bias", n * m * fe, "experts", "experts.fc1.wgrad"))
    ts.append(Tensor("experts.fc2", n * fe * h, "experts", "experts.fc2.wgrad"))
    if model.bias:
        ts.append(Tensor("experts.fc2.bias", n * h, "experts", "experts.fc2.wgrad"))
    return ts


def synced_layer_tensors(model: ModelSpec, par: ParallelPlan, layer: int) -> list[Tensor]:
    """A layer's tensors on one rank that the dense data-parallel pass reduces (and ZeRO/FSDP
    shards): ``layer_tensors``, plus a MoE layer's routed experts when they live on the dense
    groups (ep=1, etp=tp: expert-data-parallel = DP); else their own pass reduces them over
    the expert-data-parallel group (twin/schedule/moe.py)."""
    ts = layer_tensors(model, par.tp, layer)
    if model.moe is not None and model.moe.is_moe_layer(layer) and par.ep == 1 \
            and par.expert_tp == par.tp:
        ts += expert_tensors(model, 1, par.tp)
    return ts


def expert_params(model: ModelSpec, ep: int = 1, etp: int = 1) -> int:
    """Routed-expert parameters of one MoE layer on one rank (sum of ``expert_tensors``)."""
    return sum(t.numel for t in expert_tensors(model, ep, etp)) if model.moe else 0


@dataclass(frozen=True)
class LayerParams:
    """Parameters of one transformer layer held by one TP rank."""

    attention: int
    mlp: int
    norms: int

    @property
    def total(self) -> int:
        return self.attention + self.mlp + self.norms


def layer_params(model: ModelSpec, tp: int = 1, layer: int | None = None) -> LayerParams:
    """One layer's parameters on one TP rank, by block (sums of ``layer_tensors``; a MoE
    layer's routed experts are not in it: ``expert_params``)."""
    moe_layer = model.moe is not None and layer is not None and model.moe.is_moe_layer(layer)
    return _layer_params(model, tp, moe_layer)


@lru_cache(maxsize=4096)
def _layer_params(model: ModelSpec, tp: int, moe_layer: bool) -> LayerParams:
    """``layer_params`` of a dense (or MoE) layer, summed once (searches ask often)."""
    by = {"attention": 0, "mlp": 0, "norms": 0}
    for t in layer_tensors(model, tp, model.moe.moe_layers(model.num_layers)[0]
                           if moe_layer else None):
        by[t.block] += t.numel
    return LayerParams(**by)


def embedding_tensors(model: ModelSpec, tp: int = 1) -> list[Tensor]:
    """Input side on one TP rank: word embedding V/t x h (vocab-parallel), learned positions."""
    ts = [Tensor("embed.weight", vocab_rows(model, tp) * model.hidden_size, "embedding",
                 "embed.bwd")]
    if model.position_embedding == "learned":
        ts.append(Tensor("pos_embed.weight", model.seq_len * model.hidden_size, "embedding",
                         "embed.bwd"))
    return ts


def head_tensors(model: ModelSpec, tp: int = 1, *, holds_copy: bool = False) -> list[Tensor]:
    """Output side on one TP rank: final norm, then the LM head V/t x h unless tied.

    ``holds_copy``: a tied head on a last pipeline stage that is not the first keeps its
    own copy of the word embedding (Megatron; gradients all-reduced with stage 0).
    """
    h = model.hidden_size
    ts = [Tensor("final_norm.weight", h, "head", "final_norm.bwd")]
    if model.norm == "layernorm":
        ts.append(Tensor("final_norm.bias", h, "head", "final_norm.bwd"))
    if not model.tie_embeddings or holds_copy:
        ts.append(Tensor("lm_head.weight", vocab_rows(model, tp) * h, "head", "lm_head.wgrad"))
    return ts


def norm_params(model: ModelSpec) -> int:
    """One norm: 2h for LayerNorm (scale and shift), h for RMSNorm."""
    return (2 if model.norm == "layernorm" else 1) * model.hidden_size


def vocab_rows(model: ModelSpec, tp: int) -> int:
    """Rows of the vocab-parallel embedding / LM head on one TP rank: ceil(V/t)."""
    return -(-model.vocab_size // tp)


def embedding_params(model: ModelSpec, tp: int = 1) -> int:
    """Parameters of ``embedding_tensors``."""
    return sum(t.numel for t in embedding_tensors(model, tp))


def head_params(model: ModelSpec, tp: int = 1, *, holds_copy: bool = False) -> int:
    """Parameters of ``head_tensors``."""
    return sum(t.numel for t in head_tensors(model, tp, holds_copy=holds_copy))


def model_params(model: ModelSpec) -> int:
    """Unique parameters of the whole model (every expert of a MoE model)."""
    if model.moe is not None:
        return sum(layer_params(model, 1, i).total for i in range(model.num_layers)) + \
            len(model.moe.moe_layers(model.num_layers)) * expert_params(model) + \
            embedding_params(model) + head_params(model)
    return (model.num_layers * layer_params(model).total + embedding_params(model)
            + head_params(model))


def active_params(model: ModelSpec) -> int:
    """Parameters one token passes through: all but the routed experts it does not visit,
    embedding and head counted whole (Mixtral's 12.9B, Jiang et al. 2024, §2, counts so).
    A dense model's are all of them."""
    if model.moe is None:
        return model_params(model)
    moe = model.moe
    idle = (moe.num_experts - moe.experts_per_token) * expert_params(model) // moe.num_experts
    return model_params(model) - len(moe.moe_layers(model.num_layers)) * idle


def stage_params(job: Job, stage: int) -> int:
    """Parameters on one rank of pipeline stage ``stage`` (TP-sharded, routed experts
    EP x ETP-sharded, not DP-sharded)."""
    model, tp = job.model, job.parallel.tp
    if model.moe is not None:
        par = job.parallel
        ep, etp = par.ep, par.expert_tp
        layers = job.layers_on_stage(stage)
        n = sum(layer_params(model, tp, i).total for i in layers) + \
            sum(model.moe.is_moe_layer(i) for i in layers) * expert_params(model, ep, etp)
    else:
        n = len(job.layers_on_stage(stage)) * layer_params(model, tp).total
    embed_stage, head_stage = job.chunk_stage(0), job.head_stage  # Job.placement
    if stage == embed_stage:
        n += embedding_params(model, tp)
    if stage == head_stage:
        n += head_params(model, tp, holds_copy=head_stage != embed_stage and model.tie_embeddings)
    return n


def fsdp_layer_units(job: Job, stage: int) -> list[int]:
    """Each layer's parameters on one rank of ``stage`` that the dense data-parallel pass
    reduces (FSDP's layer units: ``synced_layer_tensors``, a MoE layer's routed experts
    included when they live on the dense groups); the stage's root unit (embedding, head)
    is ``stage_params`` less their sum."""
    return [sum(t.numel for t in synced_layer_tensors(job.model, job.parallel, i))
            for i in job.layers_on_stage(stage)]


FP8_LINEARS = frozenset({"qkv", "k_proj", "out_proj", "fc_gate", "fc_up", "fc1", "fc2"})
"""The GEMMs torchao's float8 converter swaps (a layer's nn.Linear; torchtitan leaves the
LM head, ``output``, in high precision): their local op names' first part (``k_proj``: the
key projection op-level SAC recomputes alone, torchtitan's ``wk``)."""


def fp8_tp_gather(par) -> bool:
    """torchao's Float8 TP styles, as torchtitan applies them (tensorwise with SP): SP's
    forward all-gathers move the shard cast to FP8, a byte per element
    (PrepareFloat8ModuleInput); the gradients' gathers stay in the model dtype."""
    return par.sp and par.tp > 1 and par.float8 == "tensorwise"


def is_fp8_weight(name: str, grad_op: str) -> bool:
    """Whether a tensor (its name and the op producing its gradient) is an FP8 linear's weight."""
    return name.endswith(".weight") and grad_op.split(".")[0] in FP8_LINEARS


def fp8_weight_numel(job: Job, stage: int) -> int:
    """Elements of the FP8 linears' weights among the FSDP layer units of ``stage`` (what
    parallel.float8_fsdp_all_gather gathers at one byte each)."""
    return sum(t.numel for i in job.layers_on_stage(stage)
               for t in synced_layer_tensors(job.model, job.parallel, i)
               if is_fp8_weight(t.name, t.grad_op))
