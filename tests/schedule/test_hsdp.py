"""HSDP (FSDP2 on a 2-D mesh): shard within dp_shard ranks, all-reduce across dp_replicate.

Closed forms: the shard group all-gathers and reduce-scatters what FSDP over dp_shard ranks
would (3 Psi per micro-batch, the root unit 2 Psi_root); the replicate group all-reduces
each reduce-scattered shard, Psi / dp_shard bytes per sync; the model states are divided by
dp_shard, not dp.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from tests.conftest import cluster, gpt
from twin.schedule.builder import build_schedule
from twin.schedule.check import check_schedule
from twin.spec import ConfigError, ParallelPlan, RankGrid, build_job
from twin.workload.comm import step_traffic
from twin.workload.memory import rank_memory
from twin.workload.params import stage_params


def _job(nodes=2, **plan):
    base = dict(zero_stage=3, dp_replicate=2, global_batch_size=32)
    base.update(plan)
    return build_job(gpt(), cluster(nodes=nodes), ParallelPlan(**base))


def test_grid_splits_the_dp_group_into_shard_and_replicate_groups():
    # torchtitan's mesh (dp_replicate, dp_shard, cp, tp): dp_shard is the inner part of dp,
    # so a shard group is dp_shard consecutive dp coordinates
    g = RankGrid.build(dp=8, tp=2, pp=1, order=("tp", "cp", "pp", "dp"), gpus_per_node=8,
                       dp_shard=4)
    assert g.group(0, "dp") == (0, 2, 4, 6, 8, 10, 12, 14)
    assert g.group(5, "dp_shard") == (1, 3, 5, 7)
    assert g.group(5, "dp_replicate") == (5, 13)
    assert g.group_rank(13, "dp_shard") == 2 and g.group_rank(13, "dp_replicate") == 1
    shard = g.groups("dp_shard")
    assert len(shard) == 4 and sorted(r for grp in shard for r in grp) == list(range(16))
    assert set(g.group(5, "tp-dp_shard")) == {0, 1, 2, 3, 4, 5, 6, 7}


def test_build_job_resolves_dp_shard_and_checks_the_product():
    job = _job()
    assert (job.parallel.dp, job.parallel.dp_replicate, job.parallel.dp_shard) == (16, 2, 8)
    assert job.parallel.shard_degree == 8
    plain = build_job(gpt(), cluster(nodes=2), ParallelPlan(zero_stage=3, global_batch_size=32))
    assert plain.parallel.dp_shard is None and plain.parallel.shard_degree == 16


@pytest.mark.parametrize("plan, words", [
    (dict(dp_replicate=3), "dp_replicate=3 does not divide dp=16"),
    (dict(dp_replicate=2, dp_shard=4), "dp_replicate * dp_shard = 2 * 4 = 8 but dp=16"),
    (dict(dp_replicate=2, zero_stage=1), "set parallel.zero_stage=3"),
    (dict(dp_replicate=0), "dp_replicate=0 must be a positive integer"),
])
def test_bad_hsdp_plans_say_what_to_change(plan, words):
    base = dict(zero_stage=3, global_batch_size=32)
    base.update(plan)
    with pytest.raises(ConfigError, match=words.replace("*", r"\*")):
        build_job(gpt(), cluster(nodes=2), ParallelPlan(**base))


def _assert_dp_bytes_are_the_closed_form(job, prog) -> None:
    """Per data-parallel group (dp, dp_shard, dp_replicate) and kind, the program's bytes are
    workload.comm's closed form."""
    got = defaultdict(float)
    for op in prog.ops:
        if op.is_collective and op.group_name.startswith("dp"):
            got[(op.group_name, op.kind)] += op.bytes
    want = {(g, k): b for g, t in step_traffic(job, 0).items() for k, (_, b) in t.calls.items()
            if g.startswith("dp")}
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == pytest.approx(want[key]), key


def test_hsdp_traffic_closed_form():
    job = _job()
    fsdp8 = build_job(gpt(), cluster(nodes=1), ParallelPlan(zero_stage=3, global_batch_size=16))
    t, f = step_traffic(job, 0), step_traffic(fsdp8, 0)
    # the shard group moves what FSDP over 8 ranks moves (same micro-batches: 2 per rank)
    assert t["dp_shard"].size == 8 and t["dp_shard"].calls == f["dp"].calls
    psi = stage_params(job, 0) * 4  # gradients reduced in fp32 (parallel.fsdp_reduce_dtype)
    syncs = job.parallel.num_microbatches  # FSDP reduce-scatters every micro-batch
    assert t["dp_replicate"].size == 2
    assert t["dp_replicate"].calls == {"all_reduce": [syncs, syncs * psi / 8]}
    assert "dp" not in t


def test_hsdp_program_moves_the_closed_form_bytes_and_reduces_after_each_shard():
    job = _job()
    prog = build_schedule(job).program(0)
    _assert_dp_bytes_are_the_closed_form(job, prog)
    ars = [op for op in prog.ops if op.kind == "all_reduce" and op.group_name == "dp_replicate"]
    assert len(ars) == sum(op.kind == "reduce_scatter" for op in prog.ops) > 0
    for op in ars:  # each all-reduces the shard its reduce-scatter produced
        assert op.group == job.grid.group(0, "dp_replicate")
        assert any(prog.ops[d].kind == "reduce_scatter" for d in op.deps), op.name
    adam = next(op for op in prog.ops if op.kind == "optimizer")
    assert adam.shape[0] == -(-stage_params(job, 0) // 8)


def test_hsdp_model_states_divide_by_dp_shard():
    hsdp = rank_memory(_job(), 0)
    fsdp8 = rank_memory(build_job(gpt(), cluster(nodes=1),
                                  ParallelPlan(zero_stage=3, global_batch_size=16)), 0)
    assert (hsdp.params, hsdp.grads, hsdp.optimizer) == \
        pytest.approx((fsdp8.params, fsdp8.grads, fsdp8.optimizer))


@pytest.mark.parametrize("plan", [dict(), dict(tp=2), dict(pp=2, global_batch_size=64),
                                  dict(fsdp_reshard_after_forward=False),
                                  dict(grad_sync="last")])
def test_hsdp_plans_are_deadlock_free(plan):
    job = _job(**plan)
    assert check_schedule(build_schedule(job).programs())["ops"] > 0


@pytest.mark.parametrize("plan", [dict(dp_replicate=1), dict(dp_replicate=2)])
def test_fsdp_of_a_moe_model_gathers_its_experts_with_each_layer(plan):
    """With ep=1 the routed experts live on the dense groups, in their layer's FSDP unit:
    the closed form gathers them with the layer (not once, as the root) and the static
    memory model's gathered buffers hold two layer units, not the experts twice over."""
    from dataclasses import replace

    from tests.spec.moe_helpers import preset_model
    moe = preset_model("mixtral_8x7b", num_layers=4, hidden_size=256, num_heads=8, num_kv_heads=2,
                       ffn_hidden_size=512, vocab_size=1000, seq_len=128)
    moe = replace(moe, moe=replace(moe.moe, moe_ffn_hidden_size=512))
    job = build_job(moe, cluster(nodes=2), ParallelPlan(zero_stage=3, global_batch_size=32, **plan))
    prog = build_schedule(job).program(0)
    _assert_dp_bytes_are_the_closed_form(job, prog)
    unit = max(op.bytes for op in prog.ops if op.kind == "all_gather")
    assert rank_memory(job, 0).buffers < 6 * unit  # root x2 + two gathered units + a grad


def test_a_shard_group_of_one_all_reduces_after_the_gradients():
    # dp_shard=1 (pure replication): no reduce-scatter, so each replica all-reduce waits for
    # the gradient copy-in (it had no dependency and ran micro-batches ahead, found as
    # fast-forward differing from the full step by 1.2e-4)
    from twin.sim.engine import SimOptions
    from twin.sim.run import simulate

    job = _job(nodes=1, tp=4, sp=True, global_batch_size=16)
    assert job.grid.dp_shard == 1
    prog = build_schedule(job).program(0)
    ars = [op for op in prog.ops if op.name.endswith("grad.ar")]
    assert ars and not any(op.name.endswith("grad.rs") for op in prog.ops)
    for op in ars:
        assert [prog.ops[d].name.rsplit("/", 1)[-1] for d in op.deps] in (
            ["grad.copy_in"], ["root.grad.copy_in"])
    full, ff = (simulate(job, None, SimOptions(fold="none", fast_forward=f),
                         trace="none").summary["step_time_s"] for f in (False, True))
    assert ff == pytest.approx(full, rel=1e-12)
