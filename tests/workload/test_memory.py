"""Memory model: the ZeRO paper's example exactly, Korthikanti's Table 2 rows, pipeline factors."""

from __future__ import annotations

import dataclasses

import pytest

from tests.conftest import cluster, gpt
from twin.spec import ParallelPlan, build_job
from twin.workload.memory import (
    activation_bytes_per_layer,
    inflight_microbatches,
    model_state_bytes,
    rank_memory,
)
from twin.workload.params import stage_params


@pytest.mark.parametrize("stage, gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_example(stage, gb):
    # ZeRO §5 / Figure 1: Psi = 7.5B, N_d = 64, K = 12 -> 120 / 31.4 / 16.6 / 1.9 GB.
    mem = model_state_bytes(7.5e9, dp=64, zero_stage=stage)
    assert round((mem.params + mem.grads + mem.optimizer) / 1e9, 1) == gb


@pytest.mark.parametrize("nd, col", [(1, (120, 120, 120)), (4, (52.5, 41.25, 30)),
                                     (16, (35.625, 21.5625, 7.5)), (1024, (30.087890625,
                                                                           15.1025390625,
                                                                           0.1171875))])
def test_zero_table1_columns_for_7_5b(nd, col):
    got = [sum(vars(model_state_bytes(7.5e9, nd, z)).values()) / 1e9 for z in (1, 2, 3)]
    assert got == pytest.approx(list(col), rel=1e-12)


# GPT-3 175B shapes (Korthikanti Table 3): a = 96, s = 2048, h = 12288, t = 8, b = 1.
A, S, H, T, B = 96, 2048, 12288, 8, 1
SBH = S * B * H


def _gpt3():
    return gpt(num_layers=96, hidden_size=H, num_heads=A, num_kv_heads=A, ffn_hidden_size=4 * H,
               seq_len=S, vocab_size=51200)


@pytest.mark.parametrize("tp, sp, recompute, expected", [
    (1, False, "none", SBH * (34 + 5 * A * S / H)),                    # Eq. 1
    (T, False, "none", SBH * (10 + 24 / T + 5 * A * S / (H * T))),     # Eq. 2
    (T, True, "none", SBH * (34 / T + 5 * A * S / (H * T))),           # Eq. 4
    (T, False, "selective", SBH * (10 + 24 / T)),
    (T, True, "selective", SBH * 34 / T),
    (1, False, "full", 2 * SBH),
    (T, False, "full", 2 * SBH),
])
def test_korthikanti_table2(tp, sp, recompute, expected):
    got = activation_bytes_per_layer(_gpt3(), B, tp=tp, sp=sp, recompute=recompute,
                                     flash_attention=False)
    assert got == pytest.approx(expected, rel=1e-12)


def test_full_recompute_under_sp_stores_the_sharded_input():
    got = activation_bytes_per_layer(_gpt3(), B, tp=T, sp=True, recompute="full")
    assert got == 2 * SBH / T


def test_korthikanti_selective_saving_for_gpt3():
    # §5: selective recomputation saves 70% of GPT-3's activation memory (5as/h = 80).
    m = _gpt3()
    full = activation_bytes_per_layer(m, B, T, True, "none", False)
    sel = activation_bytes_per_layer(m, B, T, True, "selective", False)
    assert 1 - sel / full == pytest.approx(0.70, abs=0.005)


def test_flash_attention_keeps_no_scores_but_its_logsumexp():
    m = _gpt3()
    flash = activation_bytes_per_layer(m, B, T, True, "none", flash_attention=True)
    sel = activation_bytes_per_layer(m, B, T, True, "selective", flash_attention=False)
    assert flash - sel == 4 * S * B * A // T


def test_gqa_swiglu_terms():
    # Llama style, no dropout: 4 replicated norm/GEMM inputs, Q, K, V, out-proj input, 3 MLP tensors.
    m = gpt(hidden_size=4096, num_heads=32, num_kv_heads=8, ffn_hidden_size=14336,
            activation="swiglu", seq_len=8192)
    sbh = 8192 * 4096
    expected = 2 * (4 * sbh + 8192 * (4096 + 2 * 1024 + 4096) + 3 * 8192 * 14336)
    got = activation_bytes_per_layer(m, 1, recompute="selective", flash_attention=False)
    assert got == expected


def _job(pp, schedule, m, v=1, layers=96, tp=1):
    model = dataclasses.replace(_gpt3(), num_layers=layers)
    plan = ParallelPlan(tp=tp, pp=pp, pp_schedule=schedule, pp_virtual_stages=v,
                        global_batch_size=m, sp=tp > 1, flash_attention=False)
    return build_job(model, cluster(gpus=pp * tp), plan)


def test_inflight_microbatches_per_schedule():
    assert inflight_microbatches(_job(8, "gpipe", 16), 3) == 16
    assert [inflight_microbatches(_job(8, "1f1b", 16), s) for s in (0, 3, 7)] == [8, 5, 1]
    # interleaved, stage 0: p (1 + (p-1)/(p v)) layer-sets (Korthikanti §4.2.3)
    p, v = 8, 3
    assert inflight_microbatches(_job(p, "interleaved", 16, v=v), 0) == \
        pytest.approx(p * (1 + (p - 1) / (p * v)))


def test_1f1b_first_stage_holds_all_layers_worth():
    # Korthikanti Eq. 5: with TP+SP, 1F1B's first stage holds (sbhL/t)(34 + 5as/h).
    j = _job(8, "1f1b", 16, tp=8)
    mem = rank_memory(j, j.grid.rank(pp=0))
    layers_term = SBH * 96 / T * (34 + 5 * A * S / H)
    embedding_dropout = SBH / T * 8  # sbhp/t (§4.3)
    assert mem.activations == pytest.approx(layers_term + embedding_dropout, rel=1e-12)


def test_rank_memory_model_states_follow_zero():
    m = gpt()
    for zero in (0, 1, 2, 3):
        j = build_job(m, cluster(), ParallelPlan(zero_stage=zero))
        mem = rank_memory(j, 0)
        ref = model_state_bytes(stage_params(j, 0), 8, zero)
        assert (mem.params, mem.grads, mem.optimizer) == (ref.params, ref.grads, ref.optimizer)
        assert (mem.buffers > 0) == (zero == 3)


def test_fsdp_without_reshard_keeps_every_unit_gathered():
    m = gpt()
    on = rank_memory(build_job(m, cluster(), ParallelPlan(zero_stage=3)), 0)
    off = rank_memory(build_job(m, cluster(), ParallelPlan(
        zero_stage=3, fsdp_reshard_after_forward=False)), 0)
    assert off.buffers > on.buffers and off.params == on.params


def test_legacy_dp_device_zero_carries_more():
    j = build_job(gpt(), cluster(), ParallelPlan(legacy_dp=True))
    zero, other = rank_memory(j, 0), rank_memory(j, 1)
    assert zero.total > other.total and other.optimizer == 0 and zero.buffers > 0
