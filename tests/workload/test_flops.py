"""FLOPs identities: Megatron's closed forms, GQA and SwiGLU counted term by term."""

from __future__ import annotations

import pytest

from tests.conftest import gpt
from twin.workload.flops import (
    attention_core_flops,
    hardware_flops_per_step,
    layer_forward_flops,
    layer_gemms,
    model_flops_per_step,
    recompute_forward_flops,
)

GPT_SHAPES = [  # (layers, hidden, heads, seq, vocab, batch)
    (96, 12288, 96, 2048, 51200, 64),     # GPT-3 175B, Korthikanti Table 3
    (48, 6144, 64, 2048, 51200, 4),       # 22B
    (105, 20480, 128, 2048, 51200, 280),  # 530B
    (12, 768, 12, 1024, 50304, 8),        # GPT-2 small
]


def _gpt(layers, h, a, s, v):
    return gpt(num_layers=layers, hidden_size=h, num_heads=a, num_kv_heads=a,
               ffn_hidden_size=4 * h, seq_len=s, vocab_size=v)


@pytest.mark.parametrize("l, h, a, s, v, B", GPT_SHAPES)
def test_model_flops_match_korthikanti_eq7(l, h, a, s, v, B):
    # 72 B s l h^2 (1 + s/6h + V/12hl): no recomputation.
    expected = 72 * B * s * l * h**2 * (1 + s / (6 * h) + v / (12 * h * l))
    assert model_flops_per_step(_gpt(l, h, a, s, v), B) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("l, h, a, s, v, B", GPT_SHAPES)
def test_full_recompute_flops_match_narayanan_eq3(l, h, a, s, v, B):
    # 96 B s l h^2 (1 + s/6h + V/16lh): one extra forward of every layer.
    expected = 96 * B * s * l * h**2 * (1 + s / (6 * h) + v / (16 * l * h))
    got = hardware_flops_per_step(_gpt(l, h, a, s, v), B, recompute="full")
    assert got == pytest.approx(expected, rel=1e-9)


def test_korthikanti_table5_mfu_175b():
    # published.md: model FLOPs of the 175B row = 1.411e17; / (13.75 s * 64 * 312e12) = 51.4%.
    f = model_flops_per_step(_gpt(96, 12288, 96, 2048, 51200), 64)
    assert f == pytest.approx(1.411e17, rel=1e-3)
    assert f / (13.75 * 64 * 312e12) == pytest.approx(0.514, abs=5e-4)


def test_selective_recompute_adds_one_attention_core_forward():
    m = _gpt(4, 256, 8, 128, 1000)
    extra = hardware_flops_per_step(m, 2, "selective") - model_flops_per_step(m, 2)
    assert extra == 4 * attention_core_flops(m, 2) == 4 * 4 * 2 * 128**2 * 256


def test_gqa_and_swiglu_gemms():
    m = gpt(hidden_size=4096, num_heads=32, num_kv_heads=8, ffn_hidden_size=14336,
            activation="swiglu")
    g = {x.name: x for x in layer_gemms(m, tokens=10)}
    assert g["qkv"].n == 4096 + 2 * 1024  # Q plus 8 KV heads of 128 each
    assert [g[k].n for k in ("fc_gate", "fc_up")] == [14336, 14336] and g["fc2"].k == 14336
    per_token = 2 * (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336)
    assert sum(x.flops for x in g.values()) == 10 * per_token


def test_tp_splits_flops_evenly_without_kv_replication():
    m = gpt(num_kv_heads=8)
    assert layer_forward_flops(m, 2, tp=4) * 4 == layer_forward_flops(m, 2, tp=1)


def test_kv_replication_costs_extra_flops():
    # 2 KV heads on 8 TP ranks: each rank computes one (replicated) KV head.
    m = gpt(num_heads=8, num_kv_heads=2)
    qkv = {t: layer_gemms(m, 1, tp=t)[0].n for t in (1, 8)}
    assert qkv[1] == 256 + 2 * 2 * 32 and qkv[8] == 32 + 2 * 32
    assert 8 * qkv[8] > qkv[1]


def test_early_stop_leaves_the_down_projection_out_of_full_recompute():
    m = gpt(activation="swiglu")
    b, t = 2, 2
    whole = recompute_forward_flops(m, b, t, "full", True)
    assert whole == layer_forward_flops(m, b, t)
    fc2 = 2 * b * m.seq_len * m.ffn_hidden_size * m.hidden_size // t
    assert recompute_forward_flops(m, b, t, "full", True, early_stop=True) == whole - fc2
    for policy in ("none", "selective", "op"):  # the others stop where they stop already
        assert recompute_forward_flops(m, b, t, policy, True, early_stop=True) == \
            recompute_forward_flops(m, b, t, policy, True)
