"""Mixture-of-experts workload: the deterministic routing model, token traffic and FLOPs.

Routing model. Each layer has expert loads p_e (uniform: 1/E; skewed: proportional to
1 + skew * u_e with u_e ~ U(-1, 1) drawn from ``numpy.random.default_rng((seed, layer))``),
the same for every source rank and micro-batch (a trained router's preference for some
experts, stable over a step). A rank routing n tokens sends n * k token copies; expert e
gets the largest-remainder share of n * k * p_e, capped at ceil(capacity_factor * n * k / E)
when a capacity is set (GShard, Lepikhin et al. 2020, §2.2; overflow dropped). Every EP
rank holds E / ep consecutive experts, so the tokens a source sends to EP peer j are the sum
over j's experts, and peer j receives that from each of the ep sources (each ETP peer, under
sequence parallelism, routes its own n tokens the same way: the ETP all-gather is even).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from twin.spec import ModelSpec
from twin.spec.moe import MoESpec


@lru_cache(maxsize=4096)
def expert_loads(moe: MoESpec, layer: int) -> tuple[float, ...]:
    """p_e of ``layer``: the share of routed tokens each expert gets (sums to 1)."""
    if moe.routing == "uniform":
        return (1.0 / moe.num_experts,) * moe.num_experts
    rng = np.random.default_rng((moe.routing_seed, layer))
    w = 1.0 + moe.routing_skew * rng.uniform(-1.0, 1.0, moe.num_experts)
    return tuple(float(x) for x in w / w.sum())


def _largest_remainder(total: int, shares: np.ndarray) -> np.ndarray:
    """Integers summing to ``total`` proportional to ``shares`` (ties to the lower index)."""
    exact = total * shares / shares.sum()
    out = np.floor(exact).astype(np.int64)
    left = total - int(out.sum())
    order = np.argsort(-(exact - out), kind="stable")
    out[order[:left]] += 1
    return out


@lru_cache(maxsize=4096)
def tokens_per_expert(moe: MoESpec, layer: int, tokens: int) -> tuple[int, ...]:
    """Token copies one source rank of ``tokens`` tokens sends each expert of ``layer``."""
    k, e = moe.experts_per_token, moe.num_experts
    counts = _largest_remainder(tokens * k, np.array(expert_loads(moe, layer)))
    if moe.capacity_factor is not None:
        cap = math.ceil(moe.capacity_factor * tokens * k / e - 1e-9)
        counts = np.minimum(counts, cap)
    return tuple(int(c) for c in counts)


@dataclass(frozen=True)
class Traffic:
    """One MoE layer's token traffic on one EP rank, in tokens (multiply by h * bytes)."""

    send: tuple[int, ...]
    """Token copies this rank sends each EP peer (group order, itself included)."""
    recv: tuple[int, ...]
    """Token copies it receives from each EP peer."""

    @property
    def sent(self) -> int:
        return sum(self.send)

    @property
    def received(self) -> int:
        """Tokens its local experts compute (before the ETP all-gather)."""
        return sum(self.recv)

    @property
    def even(self) -> bool:
        """Every peer gets and gives the same: an ordinary all-to-all."""
        return len(set(self.send)) == 1 and len(set(self.recv)) == 1


def traffic(moe: MoESpec, layer: int, tokens: int, ep: int, ep_rank: int) -> Traffic:
    """The dispatch traffic of EP rank ``ep_rank`` routing ``tokens`` tokens (the combine
    is its mirror: send and recv swapped)."""
    counts = tokens_per_expert(moe, layer, tokens)
    per = moe.num_experts // ep
    to_peer = tuple(sum(counts[j * per:(j + 1) * per]) for j in range(ep))
    # every source routes the same way: this rank gets to_peer[ep_rank] from each of them
    return Traffic(send=to_peer, recv=(to_peer[ep_rank],) * ep)


def even_routing(model: ModelSpec, tokens: int, ep: int) -> bool:
    """Whether every EP rank of every MoE layer sends, receives and computes the same (so
    the ranks of a stage run the same program, up to their groups)."""
    moe = model.moe
    if moe is None or ep == 1:
        return True
    for layer in moe.moe_layers(model.num_layers):
        if not traffic(moe, layer, tokens, ep, 0).even:
            return False
    return True


def moe_mlp_forward_flops(model: ModelSpec, tokens: int) -> int:
    """Model FLOPs of a MoE layer's MLP part on ``tokens`` tokens (dropless, as model FLOPs
    count): router 2nhE, routed experts 2 n k (m+1) h f_e, shared experts 2 n (m+1) h s f_e,
    m = 2 gate and up matrices for SwiGLU, 1 for GELU."""
    moe, h = model.moe, model.hidden_size
    m = 2 if model.activation == "swiglu" else 1
    visits = moe.experts_per_token + moe.shared_experts
    return 2 * tokens * h * moe.num_experts + 2 * tokens * visits * (m + 1) * h * \
        moe.moe_ffn_hidden_size
