"""Context-parallel plans that cannot work fail early, in one line naming the field, the value
and the fix."""

from __future__ import annotations

import pytest

from tests.conftest import cluster, gpt
from twin.spec import ConfigError, ParallelPlan, build_job
from twin.spec.moe import MoESpec


def job(model=None, gpus=8, **kw):
    return build_job(model or gpt(), cluster(gpus=gpus), ParallelPlan(**kw))


def one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


def test_cp_must_divide_the_sequence():
    with pytest.raises(ConfigError) as err:
        job(gpt(seq_len=96), gpus=5, cp=5, cp_load_balance="none")
    assert "cp=5 does not divide model.seq_len=96" in one_line(err)
    assert "use cp in 1, 2, 3, 4, 6, 8" in one_line(err)


def test_headtail_needs_2cp_chunks():
    job(gpt(seq_len=96), gpus=3, cp=3)  # 6 chunks of 16 tokens
    with pytest.raises(ConfigError) as err:
        job(gpt(seq_len=100), gpus=4, cp=4)
    assert "2 * cp = 8 does not divide model.seq_len=100" in one_line(err)
    assert "cp_load_balance=headtail splits each sequence in 8 chunks" in one_line(err)
    job(gpt(seq_len=100), gpus=4, cp=4, cp_load_balance="none")  # 4 chunks of 25 tokens


def test_alltoall_heads_error():
    with pytest.raises(ConfigError) as err:
        job(gpt(num_heads=4, num_kv_heads=4, hidden_size=256), cp=4, tp=2, cp_method="alltoall")
    assert "cp_method=alltoall splits the heads over tp * cp = 2 * 4 = 8 but " \
           "model.num_heads=4" in one_line(err)


def test_alltoall_kv_heads_must_split_or_replicate():
    with pytest.raises(ConfigError) as err:
        job(gpt(num_heads=12, num_kv_heads=3, hidden_size=384), gpus=4, cp=4, cp_method="alltoall",
            cp_load_balance="none")
    assert "with 3 KV heads per TP rank" in one_line(err)


def test_cp_with_legacy_dp_is_refused():
    with pytest.raises(ConfigError) as err:
        ParallelPlan(cp=2, legacy_dp=True)
    assert "parallel.cp=2 with parallel.legacy_dp=true" in one_line(err)


def test_cp_with_hsdp_is_refused():
    with pytest.raises(ConfigError) as err:
        ParallelPlan(cp=2, dp=4, zero_stage=3, dp_replicate=2)
    assert "parallel.dp_replicate=2 (HSDP) with parallel.cp=2 is not modelled" in one_line(err)


def test_cp_needs_flash_attention():
    with pytest.raises(ConfigError) as err:
        job(cp=2, flash_attention=False)
    assert "parallel.cp=2 needs parallel.flash_attention=true" in one_line(err)


def test_cp_with_moe_is_refused():
    moe = gpt(moe=MoESpec(num_experts=4, experts_per_token=2, moe_ffn_hidden_size=128))
    with pytest.raises(ConfigError) as err:
        job(moe, cp=2)
    assert "with a mixture-of-experts model" in one_line(err)


def test_world_size_message_names_cp():
    with pytest.raises(ConfigError) as err:
        job(gpus=8, cp=2, dp=2)
    assert "dp * tp * pp * cp = 2 * 1 * 1 * 2 = 4 but cluster test has 8 GPUs" in one_line(err)
    assert "use dp=4" in one_line(err)


def test_cp_fills_the_cluster_and_shards_states_over_dp_times_cp():
    j = job(gpus=8, cp=2, zero_stage=3)
    assert j.parallel.dp == 4 and j.parallel.shard_degree == 8 and j.grid.size("cp") == 2
