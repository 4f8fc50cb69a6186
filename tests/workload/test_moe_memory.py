"""MoE memory: expert states sharded over expert-DP, routed activations, dispatch buffers."""

from __future__ import annotations

import dataclasses

import pytest

from tests.schedule.test_moe_schedule import FE, H, K, S, job, moe_model
from twin.workload.memory import model_state_bytes, rank_memory
from twin.workload.params import expert_params, stage_params


def test_zero1_shards_expert_optimizer_over_expert_dp():
    j = job(ep=2, zero_stage=1)  # dp=4, edp=2
    experts = 3 * expert_params(j.model, 2, 1)
    dense = stage_params(j, 0) - experts
    want = model_state_bytes(dense, 4, 1).optimizer + model_state_bytes(experts, 2, 1).optimizer
    assert rank_memory(j, 0).optimizer == pytest.approx(want)
    assert rank_memory(j, 0).params == model_state_bytes(stage_params(j, 0), 4, 1).params


@pytest.mark.parametrize("shared", [0, 1])
def test_routed_activations_replace_the_dense_mlp(shared):
    # uniform, ep=4: every rank routes n = s tokens and receives R = n k copies; per MoE
    # layer: router probs n E 4 B, 2 n k h e routed copies, R h e expert input, 3 R f_e e
    # (gate, up, product) and shared 3 n (s f_e) e, instead of the dense 3 n f e
    j = job(moe_model(shared_experts=shared), ep=4)
    dense = dataclasses.replace(j, model=dataclasses.replace(j.model, moe=None))
    e, n, r = 2, S, S * K
    layer = 4 * n * 8 + 2 * n * K * H * e + r * H * e + 3 * r * FE * e + \
        3 * n * shared * FE * e - 3 * n * j.model.ffn_hidden_size * e
    got = rank_memory(j, 0).activations - rank_memory(dense, 0).activations
    assert got == pytest.approx(3 * layer)
    assert rank_memory(j, 0).buffers == (n * K + r) * H * e  # dispatch send + receive


def test_full_recompute_keeps_only_the_layer_input():
    j = job(ep=4, recompute="full")
    dense = dataclasses.replace(j, model=dataclasses.replace(j.model, moe=None))
    assert rank_memory(j, 0).activations == rank_memory(dense, 0).activations


def test_the_schedule_shards_expert_states_and_steps_over_expert_dp():
    from twin.schedule.builder import build_schedule

    j = job(ep=2, zero_stage=1)  # dp=4, edp=2
    experts = 3 * expert_params(j.model, 2, 1)
    dense = stage_params(j, 0) - experts
    ops = build_schedule(j).program(0).ops
    adam = next(op for op in ops if op.kind == "optimizer")
    assert adam.shape[0] == -(-dense // 4) + experts // 2
    alloc = next(op for op in ops if op.name == "setup/alloc.model.optimizer")
    assert alloc.bytes == pytest.approx(rank_memory(j, 0).optimizer)


@pytest.mark.parametrize("skew", [0.0, 0.5])
def test_the_schedule_holds_the_activations_the_memory_model_counts(skew):
    from twin.schedule.builder import build_schedule
    from twin.schedule.check import memory_peak

    j = job(moe_model(shared_experts=1, routing="skewed" if skew else "uniform",
                      routing_skew=skew), ep=4)
    for rank in range(4):  # skewed: each rank keeps what it received
        _, cats = memory_peak(build_schedule(j).program(rank))
        assert cats["activations"] == rank_memory(j, rank).activations
