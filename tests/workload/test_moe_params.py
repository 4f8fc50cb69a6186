"""MoE parameter counts against the published totals and active counts (closed form first).

Published figures are rounded; each test states its tolerance:
- Mixtral 8x7B: 46.7B total, 12.9B active (Jiang et al. 2024, §2): within 0.05B.
- Qwen3-30B-A3B: 30.5B total, 3.3B active (Qwen3 Technical Report, Table 2): within 0.05B.
- DeepSeek-V3: 671B total (within 0.5B), 37B active (arXiv:2412.19437, abstract). Counting
  the embedding and head whole as Mixtral and Qwen3 do gives 37.56B (36.63B without the input
  embedding: the paper does not say which), so active is held within 2% of 37B.
"""

from __future__ import annotations

import pytest

from tests.conftest import gpt
from tests.spec.moe_helpers import preset_model
from twin.spec.moe import MoESpec
from twin.workload.params import (
    active_params,
    expert_params,
    expert_tensors,
    layer_params,
    model_params,
)


def test_mixtral_8x7b_closed_form():
    m = preset_model("mixtral_8x7b")
    h, f, v, layers = 4096, 14336, 32000, 32
    attn = 2 * h * h + 2 * h * 1024  # Q and O h x h, K and V h x (8 heads x 128)
    expert = 3 * h * f  # gate, up, down
    per_layer = attn + 8 * expert + 8 * h + 2 * h  # + router 8 x h + two RMSNorms
    assert model_params(m) == layers * per_layer + 2 * v * h + h
    assert model_params(m) / 1e9 == pytest.approx(46.7, abs=0.05)
    assert active_params(m) == model_params(m) - layers * 6 * expert
    assert active_params(m) / 1e9 == pytest.approx(12.9, abs=0.05)


def test_qwen3_30b_a3b():
    m = preset_model("qwen3_30b_a3b")
    assert m.head_dim == 128 and m.num_heads * m.head_dim == 4096  # q wider than h = 2048
    assert model_params(m) / 1e9 == pytest.approx(30.5, abs=0.05)
    assert active_params(m) / 1e9 == pytest.approx(3.3, abs=0.06)


def test_deepseek_v3_671b_37b():
    m = preset_model("deepseek_v3")
    mla = 7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 + 512 * 128 * 256 \
        + 128 * 128 * 7168  # MLA's five projections and two norms: 187,107,328
    assert layer_params(m, 1, 0).attention == pytest.approx(mla, rel=5e-4)
    # first 3 layers dense (3 x 7168 x 18432), then 58 MoE layers of 256 routed experts
    assert layer_params(m, 1, 0).mlp == 3 * 7168 * 18432
    assert expert_params(m) == 256 * 3 * 7168 * 2048
    assert model_params(m) / 1e9 == pytest.approx(671, abs=0.5)
    assert active_params(m) / 1e9 == pytest.approx(37, rel=0.02)
    # 8 routed + 1 shared expert of 2048 are exactly one dense MLP of 18432 per token
    assert (8 + 1) * 2048 == 18432


def test_dense_model_active_equals_total():
    m = gpt()
    assert active_params(m) == model_params(m)


def test_expert_sharding_by_ep_and_etp():
    m = gpt(activation="swiglu", moe=MoESpec(num_experts=8, experts_per_token=2,
                                             moe_ffn_hidden_size=512))
    whole = expert_params(m)
    assert whole == 8 * 3 * 256 * 512
    assert expert_params(m, ep=4, etp=2) * 8 == whole
    names = [t.name for t in expert_tensors(m, 2, 1)]
    assert names == ["experts.fc1", "experts.fc2"]


def test_moe_layer_pattern_and_shared_experts():
    moe = MoESpec(num_experts=4, experts_per_token=1, moe_ffn_hidden_size=128,
                  shared_experts=2, first_k_dense=1, moe_layer_freq=2)
    m = gpt(moe=moe)
    assert moe.moe_layers(8) == (2, 4, 6)
    dense, sparse = layer_params(m, 1, 1), layer_params(m, 1, 2)
    assert dense == layer_params(m)
    # router 4 x h, shared experts one GELU MLP of 2 x 128 with biases
    h, fs = 256, 256
    assert sparse.mlp == 4 * h + (h * fs + fs) + (fs * h + h)
    assert model_params(m) == sum(layer_params(m, 1, i).total for i in range(8)) \
        + 3 * expert_params(m) + 1000 * 256 + 128 * 256 + 1000 * 256 + 2 * 256
