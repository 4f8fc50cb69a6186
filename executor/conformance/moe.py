"""A MoE layer in plain PyTorch with expert parallelism: the conformance model's experts.

Per MoE layer (the shape twin/schedule/moe.py schedules, after Megatron-Core's all-to-all
token dispatcher): router h x E, softmax; the token copies sorted by expert and sent to the
EP ranks that hold those experts with one ``all_to_all_single`` (input/output split sizes,
``AllToAll``); the local experts as a loop of SwiGLU GEMMs over each expert's rows; the
outputs sent back with the reverse ``all_to_all_single``; each copy weighted by its router
probability and summed into its token; shared experts as one dense SwiGLU MLP of s * f_e
added. Backward is autograd's: ``AllToAll.backward`` is the all-to-all in the opposite
direction (Megatron's ``_AllToAll``).

Forced routing. The top-k choice is not the router's: token t's k experts come from the
twin's deterministic routing model (twin/workload/moe.py, ``tokens_per_expert``), so each
rank's all-to-all sizes are the schedule's, call by call. Every ``block`` tokens (the tokens
one rank routes in one micro-batch, b * s) get the same assignment: the expert ids, each
repeated by its count, fill slot j of token t from position j * n + t (distinct experts per
token as long as no expert takes more than n copies); a capacity keeps each expert's first
``capped`` copies in that order (slot-major, GShard's priority) and drops the rest. The
router still weighs each copy by softmax(logits)[t, e], so it learns. A single process
running the whole batch with the same blocks computes the same function, which is what the
loss comparison checks. Since every source routes the same counts, the receive sizes are
known without Megatron's per-layer exchange of token counts (its dispatcher's all-gather of
E integers), which the schedule does not carry either.

Gradients (Megatron-Core DDP): dense parameters, router and shared experts included, are
DDP's over the DP group; each routed expert's gradient sums every source's tokens through
the all-to-all, so it is scaled by 1 / dp and all-reduced over the expert-data-parallel
group (twin/spec/experts.py) in DDP-style buckets (reverse registration order, closed at
``ddp_bucket_MB``), each issued once its gradients are final. Clipping sums the experts'
squares over their own group after the dense ones (Megatron's ChainedOptimizer:
sqrt(dense^2 + experts^2)). The load-balancing loss (Switch Transformer, Eq. 4, in
Megatron's ``switch_load_balancing_loss_func`` form) reaches the router through
``AuxLossScaler`` in backward only; reported losses are the language-model loss.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from twin.spec import Job, ModelSpec
from twin.spec.moe import MoESpec
from twin.workload.moe import tokens_per_expert

AUX_COEFF = 1e-2
"""Load-balancing loss coefficient (Megatron's moe_aux_loss_coeff, as commonly set)."""


def routing_problems(moe: MoESpec, num_layers: int, tokens: int) -> list[str]:
    """Layers whose routing model gives an expert more than ``tokens`` copies of a block of
    ``tokens`` tokens: no top-k can do that (a token visits an expert once)."""
    out = []
    uncapped = dataclasses.replace(moe, capacity_factor=None)
    for layer in moe.moe_layers(num_layers):
        top = max(tokens_per_expert(uncapped, layer, tokens))
        if top > tokens:
            out.append(f"layer {layer}: the routing model sends {top} copies of {tokens} tokens "
                       f"to one expert, more than top-k can (a token visits an expert once); "
                       "lower model.moe.routing_skew or experts_per_token")
    return out


@lru_cache(maxsize=256)
def forced_routing(moe: MoESpec, layer: int, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(experts (n, k) int64, kept (n, k) bool) of one block of n = ``tokens`` tokens: the
    routing model's counts as a top-k assignment (see the module docstring)."""
    k = moe.experts_per_token
    uncapped = tokens_per_expert(dataclasses.replace(moe, capacity_factor=None), layer, tokens)
    capped = tokens_per_expert(moe, layer, tokens)
    seq = np.repeat(np.arange(moe.num_experts), uncapped)
    keep = np.concatenate([np.arange(u) < c for u, c in zip(uncapped, capped)])
    experts = seq.reshape(k, tokens).T.copy()  # slot j of token t: seq[j * n + t]
    if any(len(set(row)) < k for row in experts.tolist()):
        raise ValueError(f"layer {layer}: the routing model sends {max(uncapped)} copies of "
                         f"{tokens} tokens to one expert; a token visits an expert once")
    return experts, keep.reshape(k, tokens).T.copy()


class AllToAll(torch.autograd.Function):
    """all_to_all_single of rows over ``group``; backward sends the gradients back the same way
    reversed (Megatron's _AllToAll)."""

    @staticmethod
    def forward(ctx, x, group, send: list[int], recv: list[int]):
        ctx.group, ctx.send, ctx.recv = group, send, recv
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        torch.distributed.all_to_all_single(out, x.contiguous(), output_split_sizes=recv,
                                            input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        out = g.new_empty((sum(ctx.send),) + tuple(g.shape[1:]))
        torch.distributed.all_to_all_single(out, g.contiguous(), output_split_sizes=ctx.send,
                                            input_split_sizes=ctx.recv, group=ctx.group)
        return out, None, None, None


class AuxLossScaler(torch.autograd.Function):
    """Identity on ``out``; backward gives ``aux`` the gradient ``scale`` (Megatron's
    MoEAuxLossAutoScaler): the auxiliary loss trains the router without changing the loss."""

    @staticmethod
    def forward(ctx, out, aux, scale: float):
        ctx.scale = scale
        ctx.save_for_backward(aux)
        return out

    @staticmethod
    def backward(ctx, g):
        (aux,) = ctx.saved_tensors
        return g, torch.full_like(aux, ctx.scale), None


class SwiGLU(nn.Module):
    """fc2(silu(X W_gate) * (X W_up)): the shared experts, run as one MLP of s * f_e."""

    def __init__(self, h: int, f: int):
        super().__init__()
        self.fc_gate = nn.Linear(h, f, bias=False)
        self.fc_up = nn.Linear(h, f, bias=False)
        self.fc2 = nn.Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.silu(self.fc_gate(x)) * self.fc_up(x))


class Experts(nn.Module):
    """The routed experts this rank holds, stacked as Megatron's grouped experts: fc1
    (E_local, h, 2 f_e) with gate and up fused, fc2 (E_local, f_e, h)."""

    def __init__(self, n: int, h: int, f: int):
        super().__init__()
        self.fc1 = nn.Parameter(torch.empty(n, h, 2 * f))
        self.fc2 = nn.Parameter(torch.empty(n, f, h))

    def forward(self, x: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """``x``: rows grouped by local expert, ``rows[e]`` of them for expert e."""
        out = []
        for e, part in enumerate(x.split(rows)):
            gate, up = (part @ self.fc1[e]).chunk(2, dim=-1)
            out.append((F.silu(gate) * up) @ self.fc2[e])
        return torch.cat(out) if out else x[:0]


class MoEMLP(nn.Module):
    """The MLP of a MoE layer: router, routed experts (local ones under EP), shared experts.

    Registration order is the twin's (twin/workload/params.py): router, shared experts, then
    the routed experts, which are not in the dense DP group's buckets when ep > 1.
    """

    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__()
        moe, h = spec.moe, spec.hidden_size
        self.moe, self.layer = moe, layer
        self.router = nn.Linear(h, moe.num_experts, bias=False)
        self.shared = SwiGLU(h, moe.shared_ffn_hidden_size) if moe.shared_experts else None
        self.experts = Experts(moe.num_experts, h, moe.moe_ffn_hidden_size)
        self.block: int | None = None
        """Tokens per routing block (b * s of a rank's micro-batch); None: the whole input."""
        self.aux_scale = 1.0
        """The auxiliary loss's gradient weight per block (1 / micro-batches on a rank)."""
        self.ep, self.ep_rank, self.ep_group = 1, 0, None

    def shard(self, ep: int, ep_rank: int, group) -> None:
        """Keep the E / ep consecutive experts of EP rank ``ep_rank``; dispatch over ``group``."""
        per = self.moe.num_experts // ep
        lo = ep_rank * per
        with torch.no_grad():
            for name in ("fc1", "fc2"):
                full = getattr(self.experts, name)
                setattr(self.experts, name, nn.Parameter(full[lo:lo + per].clone()))
        self.ep, self.ep_rank, self.ep_group = ep, ep_rank, group

    def _aux(self, probs: torch.Tensor, counts: torch.Tensor, blocks: int, n: int):
        """Switch's load-balancing loss per block, E / (n^2 k) * sum_e P_e c_e (Megatron's
        switch_load_balancing_loss_func), times AUX_COEFF, averaged over the blocks."""
        e, k = self.moe.num_experts, self.moe.experts_per_token
        p = probs.view(blocks, n, e).sum(1)  # (blocks, E)
        return AUX_COEFF * e / (n * n * k) * (p * counts).sum() / blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        moe, shape = self.moe, x.shape
        xt = x.reshape(-1, shape[-1])
        total = xt.shape[0]
        n = self.block or total
        if total % n:
            raise ValueError(f"{total} tokens do not split into routing blocks of {n}")
        blocks = total // n
        probs = self.router(xt).float().softmax(-1)
        experts, kept = (torch.from_numpy(a).repeat(blocks, 1)
                         for a in forced_routing(moe, self.layer, n))
        weights = probs.gather(1, experts)
        if moe.router_aux_loss:  # top-k counts before any capacity drop, as Megatron's
            counts = torch.bincount(experts.reshape(-1), minlength=moe.num_experts)[None] / blocks
            aux = self._aux(probs, counts.to(probs.dtype), blocks, n)
        token = torch.arange(total).repeat_interleave(moe.experts_per_token)[kept.reshape(-1)]
        expert = experts.reshape(-1)[kept.reshape(-1)]
        order = torch.argsort(expert, stable=True)  # copies by expert, then token, then slot
        token, expert = token[order], expert[order]
        weight = weights.reshape(-1)[kept.reshape(-1)][order]
        y = self._routed(xt[token], torch.bincount(expert, minlength=moe.num_experts).tolist())
        out = torch.zeros_like(xt).index_add(0, token, y * weight[:, None].to(y.dtype))
        if self.shared is not None:
            out = out + self.shared(xt)
        if moe.router_aux_loss:
            out = AuxLossScaler.apply(out, aux, self.aux_scale)
        return out.view(shape)

    def _routed(self, copies: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Dispatch ``copies`` (sorted by expert, ``counts`` per expert), run the local
        experts, combine; returns the expert outputs in the same order."""
        ep, per = self.ep, self.moe.num_experts // self.ep
        local = counts[self.ep_rank * per:(self.ep_rank + 1) * per]  # every source's alike
        if ep == 1:
            return self.experts(copies, local)
        send = [sum(counts[j * per:(j + 1) * per]) for j in range(ep)]
        recv = [sum(local)] * ep
        got = AllToAll.apply(copies, self.ep_group, send, recv)
        # from source s: its copies for each local expert, in expert order; group by expert
        starts = np.concatenate([[0], np.cumsum(local)[:-1]]).astype(int)
        perm = torch.from_numpy(np.concatenate(
            [np.arange(s * sum(local) + starts[e], s * sum(local) + starts[e] + local[e])
             for e in range(per) for s in range(ep)]).astype(np.int64))
        y = self.experts(got[perm], [c * ep for c in local])
        y = y[torch.argsort(perm)]
        return AllToAll.apply(y, self.ep_group, recv, send)


def moe_layers(model: nn.Module) -> list[MoEMLP]:
    return [m for m in model.modules() if isinstance(m, MoEMLP)]


def route_in_blocks(model: nn.Module, tokens: int, aux_scale: float = 1.0) -> None:
    """Route every ``tokens`` tokens as one block (a rank's micro-batch, b * s)."""
    for m in moe_layers(model):
        m.block, m.aux_scale = tokens, aux_scale


def routed_tokens(job: Job) -> int:
    """Tokens one rank routes per micro-batch: b * s (tp = cp = 1 here)."""
    return job.parallel.micro_batch_size * job.model.seq_len
