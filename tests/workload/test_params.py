"""Parameter counts: Megatron's Eq. 2, published model sizes, TP sharding and GQA replication."""

from __future__ import annotations

import pytest

from tests.conftest import cluster, gpt
from twin.spec import ParallelPlan, build_job
from twin.workload.params import (
    kv_heads_per_rank,
    kv_replicas,
    layer_params,
    model_params,
    stage_params,
)


@pytest.mark.parametrize("l, h, s, v", [(96, 12288, 2048, 51200), (128, 25600, 2048, 51200)])
def test_gpt_params_match_narayanan_eq2(l, h, s, v):
    # P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h)), tied embeddings; plus the final LayerNorm 2h.
    m = gpt(num_layers=l, hidden_size=h, num_heads=h // 128, num_kv_heads=h // 128,
            ffn_hidden_size=4 * h, seq_len=s, vocab_size=v, tie_embeddings=True)
    expected = 12 * l * h**2 * (1 + 13 / (12 * h) + (v + s) / (12 * l * h)) + 2 * h
    assert model_params(m) == pytest.approx(expected, rel=1e-12)


def test_1t_row_of_published_table():
    m = gpt(num_layers=128, hidden_size=25600, num_heads=160, num_kv_heads=160,
            ffn_hidden_size=102400, seq_len=2048, vocab_size=51200, tie_embeddings=True)
    assert model_params(m) == pytest.approx(1.008e12, rel=1e-3)


@pytest.mark.parametrize("layers, h, heads, ffn, billions", [
    (32, 4096, 32, 14336, 8.03), (80, 8192, 64, 28672, 70.6), (126, 16384, 128, 53248, 405.9)])
def test_llama3_sizes(layers, h, heads, ffn, billions):
    m = gpt(num_layers=layers, hidden_size=h, num_heads=heads, num_kv_heads=8,
            ffn_hidden_size=ffn, vocab_size=128256, seq_len=8192, activation="swiglu")
    assert model_params(m) / 1e9 == pytest.approx(billions, abs=0.05)


def test_gqa_replication_under_tp():
    m = gpt(num_heads=8, num_kv_heads=2)
    assert [kv_replicas(m, t) for t in (1, 2, 4, 8)] == [1, 1, 2, 4]
    assert [kv_heads_per_rank(m, t) for t in (1, 2, 4, 8)] == [2, 1, 1, 1]
    # with replication the TP ranks together hold more attention weights than the model
    assert 8 * layer_params(m, 8).attention > layer_params(m, 1).attention


def test_tp_shards_matrices_and_replicates_norms_and_row_biases():
    m = gpt()  # h = 256, f = 1024, biases and LayerNorm
    one, four = layer_params(m, 1), layer_params(m, 4)
    h = 256
    assert four.norms == one.norms == 4 * h
    # O and FC2 biases (h each) are replicated on every TP rank
    assert 4 * four.attention == one.attention + 3 * h
    assert 4 * four.mlp == one.mlp + 3 * h


def test_stage_params_sum_over_the_pipeline():
    m = gpt(tie_embeddings=False)
    j = build_job(m, cluster(gpus=4), ParallelPlan(pp=4))
    assert sum(stage_params(j, s) for s in range(4)) == model_params(m)
    # tied embeddings: the last stage keeps its own copy of the word embedding (Megatron)
    t = build_job(gpt(tie_embeddings=True), cluster(gpus=4), ParallelPlan(pp=4))
    assert sum(stage_params(t, s) for s in range(4)) == model_params(t.model) + 1000 * 256
