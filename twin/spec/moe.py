"""MoESpec: a mixture-of-experts block of a ModelSpec (routed experts, shared experts, routing).

A MoE layer replaces the dense MLP by a router (an h x E linear, softmax, top-k), E routed
experts of inner size f_e of which each token visits k, and optionally s shared experts that
every token visits (DeepSeekMoE, Dai et al. 2024, §2). Layers before ``first_k_dense``
keep the dense MLP of ``ffn_hidden_size``; after it every ``moe_layer_freq``-th layer is a
MoE layer (HF DeepSeek-V3: ``layer >= first_k_dense_replace and layer % moe_layer_freq == 0``).
"""

from __future__ import annotations

from dataclasses import dataclass

from twin.spec.errors import check_choice, raise_if

ROUTINGS = ("uniform", "skewed")


@dataclass(frozen=True)
class MoESpec:
    """The expert layers of a model; ``ModelSpec.moe = None`` for a dense model."""

    num_experts: int = 8
    """Routed experts E per MoE layer."""
    experts_per_token: int = 2
    """Routed experts each token visits (top-k)."""
    moe_ffn_hidden_size: int = 256
    """Inner size f_e of one expert (and of one shared expert)."""
    shared_experts: int = 0
    """Experts every token visits (DeepSeekMoE), run as one dense MLP of s * f_e."""
    first_k_dense: int = 0
    """Leading layers that keep the dense MLP (DeepSeek-V3: 3)."""
    moe_layer_freq: int = 1
    """After the dense ones, every n-th layer is a MoE layer (1: all of them)."""
    router_aux_loss: bool = True
    """Load-balancing auxiliary loss (Switch Transformer, Fedus et al. 2021, Eq. 4): one
    memory-bound pass over the router's probabilities per layer, forward and backward."""
    capacity_factor: float | None = None
    """Tokens an expert takes, as a multiple of its even share (GShard); overflow is dropped.
    None: dropless (every routed token is computed)."""
    routing: str = "uniform"
    """uniform: every expert gets the same share of tokens; skewed: per-layer expert loads
    ``1 + routing_skew * u_e`` (u_e uniform in [-1, 1], drawn from ``routing_seed``)."""
    routing_skew: float = 0.0
    """Imbalance of skewed routing, 0 <= skew < 1: the busiest expert gets at most
    (1 + skew) / (1 - skew) times the tokens of the idlest."""
    routing_seed: int = 0
    """Seed of skewed routing (the same seed, the same loads, byte for byte)."""

    def __post_init__(self) -> None:
        problems: list[str] = []
        for field in ("num_experts", "experts_per_token", "moe_ffn_hidden_size",
                      "moe_layer_freq"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                problems.append(f"model.moe.{field}={value!r} must be a positive integer")
        for field in ("shared_experts", "first_k_dense", "routing_seed"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                problems.append(f"model.moe.{field}={value!r} must be a whole number >= 0")
        check_choice(problems, "model.moe.routing", self.routing, ROUTINGS)
        cf = self.capacity_factor
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float)) or cf <= 0):
            problems.append(f"model.moe.capacity_factor={cf!r} must be a positive number "
                            "(or null for dropless routing)")
        skew = self.routing_skew
        if isinstance(skew, bool) or not isinstance(skew, (int, float)) or not 0 <= skew < 1:
            problems.append(f"model.moe.routing_skew={skew!r} must be in [0, 1)")
        raise_if(problems)
        if self.experts_per_token > self.num_experts:
            problems.append(f"model.moe.experts_per_token={self.experts_per_token} exceeds "
                            f"model.moe.num_experts={self.num_experts}; use at most "
                            f"{self.num_experts}")
        if self.routing == "uniform" and skew:
            problems.append(f"model.moe.routing_skew={skew} needs model.moe.routing=skewed; "
                            "set routing=skewed or routing_skew=0")
        if self.routing == "skewed" and not skew:
            problems.append("model.moe.routing=skewed needs model.moe.routing_skew > 0 "
                            "(e.g. 0.5); or use routing=uniform")
        raise_if(problems)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer ``layer`` (0-based) has experts instead of the dense MLP."""
        return layer >= self.first_k_dense and layer % self.moe_layer_freq == 0

    def moe_layers(self, num_layers: int) -> tuple[int, ...]:
        """The MoE layers of a model of ``num_layers`` layers."""
        return tuple(i for i in range(num_layers) if self.is_moe_layer(i))

    @property
    def shared_ffn_hidden_size(self) -> int:
        """Inner size of the shared experts run as one MLP: shared_experts * f_e."""
        return self.shared_experts * self.moe_ffn_hidden_size
