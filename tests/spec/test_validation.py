"""Every validation rule of the specs: one test per rule, asserting its message."""

from __future__ import annotations

import dataclasses

import pytest

from tests.conftest import cluster, gpt
from twin.spec import (
    ClusterSpec,
    ConfigError,
    ConfigWarning,
    GPUSpec,
    InterNodeSpec,
    IntraNodeSpec,
    ParallelPlan,
    build_job,
)
from twin.spec.moe import MoESpec


def job(model=None, clu=None, **plan):
    return build_job(model or gpt(), clu or cluster(), ParallelPlan(**plan))


def test_degrees_must_multiply_to_gpu_count():
    with pytest.raises(ConfigError, match=r"dp \* tp \* pp = 2 \* 2 \* 1 = 4 but cluster test "
                                          r"has 8 GPUs .*use dp=4"):
        job(dp=2, tp=2)


def test_dp_none_fills_the_cluster_or_says_why():
    assert job(tp=2).parallel.dp == 4
    with pytest.raises(ConfigError, match=r"tp \* pp = 3 \* 1 = 3 does not divide the 8 GPUs"):
        job(model=gpt(num_heads=12, num_kv_heads=12, hidden_size=384, ffn_hidden_size=1536), tp=3)


def test_tp_must_divide_heads():
    with pytest.raises(ConfigError, match=r"tp=4 does not divide model.num_heads=6; use one of 1, 2"):
        job(model=gpt(num_heads=6, num_kv_heads=6, hidden_size=384), clu=cluster(gpus=4), tp=4)


def test_tp_must_divide_ffn():
    with pytest.raises(ConfigError, match=r"tp=8 does not divide model.ffn_hidden_size=1020"):
        job(model=gpt(ffn_hidden_size=1020), tp=8)


def test_kv_heads_must_divide_heads():
    with pytest.raises(ConfigError, match=r"model.num_kv_heads=3 does not divide "
                                          r"model.num_heads=8; use one of 1, 2, 4, 8"):
        gpt(num_kv_heads=3)


def test_heads_must_divide_hidden():
    with pytest.raises(ConfigError, match=r"model.num_heads=7 does not divide model.hidden_size=256"):
        gpt(num_heads=7, num_kv_heads=7)


def test_kv_replication_needs_tp_multiple_of_kv_heads():
    m = gpt(num_heads=24, num_kv_heads=3, hidden_size=384, ffn_hidden_size=1536)
    with pytest.raises(ConfigError, match=r"tp=8 and model.num_kv_heads=3: one must divide the "
                                          r"other .*use tp in 1, 3, 6, 12, 24"):
        job(model=m, tp=8)
    with pytest.raises(ConfigError, match=r"tp=2 and model.num_kv_heads=3"):
        job(model=m, clu=cluster(gpus=2), tp=2)


def test_pp_must_divide_layers():
    with pytest.raises(ConfigError, match=r"pp = 3 does not divide model.num_layers=8; use a total "
                                          r"of stages in 1, 2, 4, 8 or give parallel.pp_stage_layers"):
        job(clu=cluster(gpus=3), pp=3, global_batch_size=3)


def test_pp_times_virtual_stages_must_divide_layers():
    with pytest.raises(ConfigError, match=r"pp \* pp_virtual_stages = 2 \* 3 = 6 does not divide "
                                          r"model.num_layers=8"):
        job(clu=cluster(gpus=2), pp=2, pp_schedule="interleaved", pp_virtual_stages=3)


def test_uneven_stage_layers_must_add_up():
    j = job(model=gpt(num_layers=10), clu=cluster(gpus=4), pp=4, pp_stage_layers=[2, 3, 3, 2])
    assert j.stage_layers == (2, 3, 3, 2)
    assert j.layers_on_stage(1) == (2, 3, 4)
    with pytest.raises(ConfigError, match=r"pp_stage_layers sums to 9 but model.num_layers=10"):
        job(model=gpt(num_layers=10), clu=cluster(gpus=4), pp=4, pp_stage_layers=[2, 3, 2, 2])


def test_uneven_stage_layers_need_one_count_per_stage():
    with pytest.raises(ConfigError, match=r"pp_stage_layers has 3 entries but pp \* "
                                          r"pp_virtual_stages = 4"):
        ParallelPlan(pp=4, pp_stage_layers=[2, 3, 3])


def test_global_batch_divisible_by_micro_batch_times_dp():
    with pytest.raises(ConfigError, match=r"global_batch_size=12 is not divisible by "
                                          r"micro_batch_size \* dp = 2 \* 8 = 16; use a multiple "
                                          r"of 16 such as 16 or 32"):
        job(micro_batch_size=2, global_batch_size=12)


def test_1f1b_with_fewer_microbatches_than_stages_is_fill_drain():
    """Megatron runs it (warm-up min(p - rank - 1, m)); the bubble is (p - 1) / (m + p - 1)."""
    with pytest.warns(ConfigWarning, match=r"pp_schedule=1f1b with 2 micro-batch\(es\) per step "
                                           r"on pp=4 stages degenerates to fill/drain: bubble 60%"):
        j = job(pp=4, global_batch_size=4)
    assert j.parallel.num_microbatches == 2


def test_interleaved_needs_at_least_pp_microbatches():
    with pytest.raises(ConfigError, match=r"pp_schedule=interleaved needs at least pp=4"):
        job(pp=4, pp_schedule="interleaved", pp_virtual_stages=2, global_batch_size=2)


def test_gpipe_allows_fewer_microbatches_than_stages():
    assert job(pp=4, pp_schedule="gpipe", global_batch_size=2).parallel.num_microbatches == 1


def test_interleaved_needs_microbatches_multiple_of_pp():
    with pytest.raises(ConfigError, match=r"micro-batches per step \(6\) to be a multiple of "
                                          r"pp=4; set parallel.global_batch_size to a multiple of 8"):
        job(pp=4, pp_schedule="interleaved", pp_virtual_stages=2, global_batch_size=12)


def test_interleaved_needs_virtual_stages_and_pp():
    with pytest.raises(ConfigError, match=r"interleaved needs parallel.pp_virtual_stages >= 2"):
        ParallelPlan(pp=2, pp_schedule="interleaved")
    with pytest.raises(ConfigError, match=r"interleaved needs parallel.pp > 1"):
        ParallelPlan(pp=1, pp_schedule="interleaved", pp_virtual_stages=2)
    with pytest.raises(ConfigError, match=r"pp_virtual_stages=2 needs pp_schedule=interleaved"):
        ParallelPlan(pp=2, pp_virtual_stages=2)


def test_zero_with_dp_1_warns():
    with pytest.warns(ConfigWarning, match=r"zero_stage=2 with dp=1 shards over a single rank"):
        job(clu=cluster(gpus=1), zero_stage=2)


def test_sp_needs_tp():
    with pytest.raises(ConfigError, match=r"sp=true needs tensor parallelism but parallel.tp=1"):
        ParallelPlan(sp=True)


def test_fsdp_reduce_dtype_is_checked():
    assert ParallelPlan().fsdp_reduce_dtype == "fp32"  # torchtitan's mixed_precision_reduce
    with pytest.raises(ConfigError, match=r"parallel.fsdp_reduce_dtype='fp8' is not one of "
                                          r"fp32\|bf16\|fp16"):
        ParallelPlan(zero_stage=3, fsdp_reduce_dtype="fp8")


def test_op_level_sac_is_refused_where_it_is_not_modelled():
    with pytest.raises(ConfigError, match=r"recompute=op .* cp=2; set cp=1"):
        ParallelPlan(cp=2, recompute="op")
    with pytest.raises(ConfigError, match=r"recompute=op .*\(async_tp=true\)"):
        ParallelPlan(tp=2, sp=True, async_tp=True, compile=True, recompute="op")
    ParallelPlan(tp=2, sp=True, recompute="op")  # torchtitan's TP recipes use it
    moe = dataclasses.replace(gpt(), moe=MoESpec(num_experts=8, experts_per_token=2,
                                                 moe_ffn_hidden_size=256))
    with pytest.raises(ConfigError, match=r"recompute=op .* MoE layers"):
        build_job(moe, cluster(), ParallelPlan(recompute="op"))
    # PyTorch's early stop in a MoE layer falls after its weighted combine (the fsdp and hsdp
    # presets set it): accepted
    build_job(moe, cluster(), ParallelPlan(recompute="full", recompute_early_stop=True))
    build_job(gpt(), cluster(), ParallelPlan(recompute="op"))


def test_cp_fields_are_checked():
    """cp is no longer reserved; its fields are checked like the others (tests/spec/
    test_context_spec.py has the CP plans that cannot work)."""
    with pytest.raises(ConfigError, match=r"parallel.cp=0 must be a positive integer"):
        ParallelPlan(cp=0)
    with pytest.raises(ConfigError, match=r"parallel.cp_method='ulysses' is not one of "
                                          r"ring\|allgather\|alltoall"):
        ParallelPlan(cp=2, cp_method="ulysses")


def test_rank_order_must_name_every_axis():
    with pytest.raises(ConfigError, match=r"rank_order='tp-dp' must name each of tp, cp, pp, dp"):
        ParallelPlan(rank_order="tp-dp")


def test_legacy_dp_is_pure_data_parallel_on_one_node():
    with pytest.raises(ConfigError, match=r"legacy_dp=true \(nn.DataParallel\) works with tp=1"):
        ParallelPlan(legacy_dp=True, tp=2)
    with pytest.raises(ConfigError, match=r"dp=16 must fit on one node of 8 GPUs"):
        job(clu=cluster(nodes=2), legacy_dp=True)


def test_dtype_needs_a_peak():
    with pytest.raises(ConfigError, match=r"model.dtype=fp16 has no entry in cluster.gpu.peak_tflops"):
        job(model=gpt(dtype="fp16"))


@pytest.mark.parametrize("build, field", [
    (lambda: gpt(activation="relu"), "model.activation='relu' is not one of gelu|swiglu"),
    (lambda: gpt(dtype="fp8"), "model.dtype='fp8' is not one of bf16|fp16|fp32"),
    (lambda: ParallelPlan(pp_schedule="zb"), "parallel.pp_schedule='zb' is not one of "
                                             "gpipe|1f1b|interleaved"),
    (lambda: ParallelPlan(recompute="some"), "parallel.recompute='some' is not one of "
                                             "none|selective|op|full"),
    (lambda: ParallelPlan(zero_stage=4), "parallel.zero_stage=4 is not one of 0|1|2|3"),
    (lambda: cluster(intra=IntraNodeSpec(kind="nvlink")), "cluster.intra.kind='nvlink' is not "
                                                          "one of nvswitch|pcie|shared_cpu"),
    (lambda: cluster(inter=InterNodeSpec(kind="slingshot")), "cluster.inter.kind='slingshot'"),
    (lambda: cluster(inter=InterNodeSpec(topology="torus")), "cluster.inter.topology='torus' is "
                                                             "not one of fat_tree|rail_optimized"),
])
def test_unknown_enum_values(build, field):
    with pytest.raises(ConfigError) as err:
        build()
    assert field in str(err.value)


def test_positive_sizes():
    with pytest.raises(ConfigError, match=r"model.num_layers=0 must be a positive integer"):
        gpt(num_layers=0)
    with pytest.raises(ConfigError, match=r"parallel.tp=0 must be a positive integer"):
        ParallelPlan(tp=0)
    with pytest.raises(ConfigError, match=r"cluster.gpus_per_node=0 must be a positive integer"):
        cluster(gpus=0)
    with pytest.raises(ConfigError, match=r"oversubscription=0.5 must be >= 1"):
        cluster(inter=InterNodeSpec(oversubscription=0.5))
    with pytest.raises(ConfigError, match=r"cluster.gpu.peak_tflops is empty"):
        ClusterSpec(gpu=GPUSpec(peak_tflops={}))


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as err:
        job(model=gpt(num_heads=8, ffn_hidden_size=1020), tp=16)
    assert len(err.value.problems) >= 3  # world size, heads, ffn


def test_model_derives_style_from_activation():
    g, llama = gpt(), gpt(activation="swiglu")
    assert (g.norm, g.bias, g.position_embedding, g.dropout) == ("layernorm", True, "learned", True)
    assert (llama.norm, llama.bias, llama.position_embedding, llama.dropout) == \
        ("rmsnorm", False, "rope", False)
    assert gpt(activation="swiglu", dropout=True).dropout is True
