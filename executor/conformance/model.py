"""A small Llama-style nn.Module built from a ModelSpec, parameters in the twin's registration order.

Per layer (``twin.workload.params.layer_tensors``): norm1, attn.wq, attn.wk, attn.wv,
attn.wo, norm2, mlp.w_gate, mlp.w_up, mlp.fc2 (a MoE layer: mlp.router, mlp.shared.*,
mlp.experts.*, executor/conformance/moe.py); then the embedding first and the final
norm and LM head last (``embedding_tensors``, ``head_tensors``). RMSNorm, grouped-query
attention with RoPE (Su et al. 2021) and a causal mask, SwiGLU MLP (Shazeer 2020),
tied or untied embeddings, no biases and no dropout: the ``swiglu`` flavour of ModelSpec.

Head counts are read from the projections' local widths at run time, so the same forward
serves a tensor-parallel rank whose wq/wk/wv hold a column shard (heads / tp each).
Nothing is registered as a buffer (RoPE angles are computed in forward): DDP would
otherwise broadcast buffers before every forward, a collective the schedule has no
reason to carry.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from executor.conformance.moe import MoEMLP
from twin.spec import ConfigError, ModelSpec

ROPE_BASE = 10000.0


def check_model(spec: ModelSpec) -> None:
    """Raise a ConfigError when ``spec`` is not a model this module builds."""
    problems = []
    if spec.activation != "swiglu" or spec.norm != "rmsnorm" or spec.bias or \
            spec.position_embedding != "rope" or spec.dropout:
        problems.append(f"conformance builds a Llama-style model (swiglu, rmsnorm, rope, no bias, "
                        f"no dropout); model {spec.name} has activation={spec.activation}, "
                        f"norm={spec.norm}, bias={spec.bias}, position_embedding="
                        f"{spec.position_embedding}, dropout={spec.dropout}; use model=tiny")
    if spec.dtype != "fp32":
        problems.append(f"model.dtype={spec.dtype}: conformance compares losses to 1e-5 and runs "
                        "on CPU, so it trains in fp32; set model.dtype=fp32")
    if spec.head_dim % 2:
        problems.append(f"head_dim={spec.head_dim} is odd; RoPE rotates pairs, so make "
                        "hidden_size / num_heads even")
    if problems:
        raise ConfigError(problems)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * w (Zhang & Sennrich 2019)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope(x: torch.Tensor, head_dim: int, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x (batch, seq, heads, d) by position * base^(-2i/d)
    (positions: 0..seq-1, or the sequence positions a CP rank holds)."""
    seq = x.shape[1]
    inv = ROPE_BASE ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=x.device) / head_dim)
    pos = torch.arange(seq, dtype=torch.float32, device=x.device) if positions is None \
        else positions.float().to(x.device)
    ang = torch.outer(pos, inv)  # (seq, d/2)
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    """Causal GQA: Q = X Wq, K = X Wk, V = X Wv (kv heads shared by heads/kv query heads), O = A Wo."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        self.head_dim = d
        self.group = spec.num_heads // spec.num_kv_heads
        self.wq = nn.Linear(h, spec.num_heads * d, bias=False)
        self.wk = nn.Linear(h, spec.num_kv_heads * d, bias=False)
        self.wv = nn.Linear(h, spec.num_kv_heads * d, bias=False)
        self.wo = nn.Linear(spec.num_heads * d, h, bias=False)
        self.cp = None
        """Context parallelism: (CP process group, load balance, the positions this rank holds),
        attention then a ring over the group (executor/conformance/ring.py); None: local."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape[0], x.shape[1], self.head_dim
        q = self.wq(x).view(b, s, -1, d)
        k = self.wk(x).view(b, s, -1, d)
        v = self.wv(x).view(b, s, -1, d)
        if self.cp is not None:
            from executor.conformance.ring import ring_attention

            group, balance, pos = self.cp
            q, k = rope(q, d, pos), rope(k, d, pos)
            o = ring_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), group,
                               balance)
            return self.wo(o.transpose(1, 2).reshape(b, s, -1))
        q, k = rope(q, d), rope(k, d)
        k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
        v = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """SwiGLU: fc2(silu(X W_gate) * (X W_up))."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        h, f = spec.hidden_size, spec.ffn_hidden_size
        self.w_gate = nn.Linear(h, f, bias=False)
        self.w_up = nn.Linear(h, f, bias=False)
        self.fc2 = nn.Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.silu(self.w_gate(x)) * self.w_up(x))


class Layer(nn.Module):
    """Pre-norm block: x + attn(norm1(x)), then + mlp(norm2(.)); a MoE layer's mlp is
    executor/conformance/moe.py's MoEMLP (router, routed and shared experts)."""

    def __init__(self, spec: ModelSpec, index: int = 0):
        super().__init__()
        self.norm1 = RMSNorm(spec.hidden_size)
        self.attn = Attention(spec)
        self.norm2 = RMSNorm(spec.hidden_size)
        moe = spec.moe is not None and spec.moe.is_moe_layer(index)
        self.mlp = MoEMLP(spec, index) if moe else MLP(spec)
        self.checkpoint = None
        """Activation checkpointing: ``checkpoint(fn, x)`` runs the block's forward under it
        (executor/conformance/checkpoint.py); None: no checkpointing. Set on the block itself,
        not as a wrapper module, so that parameter names stay the twin's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint is not None:
            return self.checkpoint(self.block, x)
        return self.block(x)

    def block(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Llama(nn.Module):
    """embed -> layers -> final_norm -> lm_head; parts set to None are skipped (pipeline stages).

    ``layers`` is a ModuleDict keyed by the global layer index, so a pipeline stage that
    keeps layers 2 and 3 still names them ``layers.2`` and ``layers.3``.
    """

    def __init__(self, spec: ModelSpec):
        super().__init__()
        check_model(spec)
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleDict({str(i): Layer(spec, i) for i in range(spec.num_layers)})
        self.final_norm = RMSNorm(spec.hidden_size)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x)
        if self.final_norm is not None:
            x = self.final_norm(x)
        if self.lm_head is not None:
            x = self.lm_head(x)
        return x


def build_model(spec: ModelSpec, seed: int) -> Llama:
    """The model with a deterministic initialisation (normal std 0.02, norms at 1)."""
    gen = torch.Generator().manual_seed(seed)
    model = Llama(spec)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm1.weight") and not name.endswith("norm2.weight") \
                    and name != "final_norm.weight":
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return model


def make_batch(spec: ModelSpec, sequences: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids (sequences, seq_len) and next-token targets, the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, spec.vocab_size, (sequences, spec.seq_len + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every token."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
