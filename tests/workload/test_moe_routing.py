"""The routing model (uniform, skewed, capacity), per-peer traffic, and MoE model FLOPs."""

from __future__ import annotations

import pytest

from tests.spec.moe_helpers import preset_model
from twin.spec.moe import MoESpec
from twin.workload.flops import attention_core_flops, model_flops_per_step
from twin.workload.moe import expert_loads, tokens_per_expert, traffic
from twin.workload.params import active_params, embedding_params


def test_uniform_routing_is_even_per_peer():
    moe = MoESpec(num_experts=8, experts_per_token=2)
    t = traffic(moe, 0, 1024, 4, 1)
    assert t.send == (512,) * 4 and t.recv == (512,) * 4 and t.even
    assert t.sent == 1024 * 2


def test_uneven_token_count_spreads_the_remainder():
    moe = MoESpec(num_experts=4, experts_per_token=1)
    assert sorted(tokens_per_expert(moe, 0, 6)) == [1, 1, 2, 2]


@pytest.mark.parametrize("skew", [0.2, 0.5, 0.9])
def test_skew_bounds_the_imbalance_and_keeps_every_token(skew):
    moe = MoESpec(num_experts=64, experts_per_token=4, routing="skewed", routing_skew=skew)
    loads = expert_loads(moe, 7)
    assert sum(loads) == pytest.approx(1.0)
    assert max(loads) / min(loads) <= (1 + skew) / (1 - skew)
    assert max(loads) / min(loads) > 1 + skew / 2  # 64 draws: really skewed
    assert sum(tokens_per_expert(moe, 7, 4096)) == 4096 * 4
    # per layer and seed, the same loads; another layer or seed, others
    assert expert_loads(moe, 7) == loads and expert_loads(moe, 8) != loads
    other = MoESpec(num_experts=64, experts_per_token=4, routing="skewed", routing_skew=skew,
                    routing_seed=1)
    assert expert_loads(other, 7) != loads


def test_capacity_drops_the_overflow():
    moe = MoESpec(num_experts=8, experts_per_token=2, routing="skewed", routing_skew=0.8,
                  capacity_factor=1.0)
    counts = tokens_per_expert(moe, 0, 1024)
    assert max(counts) == 1024 * 2 // 8  # capacity = 1.0 x the even share
    assert sum(counts) < 1024 * 2
    t = traffic(moe, 0, 1024, 2, 0)
    assert t.sent == sum(counts) and t.recv == (t.send[0],) * 2


def test_moe_model_flops_are_six_active_gemm_params_per_token_plus_attention():
    # forward 2 FLOPs per GEMM weight a token passes (router, top-k and shared experts, the
    # attention projections, the head), backward twice that; plus the attention core
    m = preset_model("mixtral_8x7b")
    batch, tokens = 2, 2 * m.seq_len
    norms = (2 * m.num_layers + 1) * m.hidden_size
    gemm_weights = active_params(m) - embedding_params(m) - norms
    want = 3 * (2 * tokens * gemm_weights + m.num_layers * attention_core_flops(m, batch))
    assert model_flops_per_step(m, batch) == want
