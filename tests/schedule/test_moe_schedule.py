"""MoE layers under expert parallelism: closed-form all-to-all bytes, grouped-GEMM FLOPs,
expert-gradient reduction over the expert-data-parallel group, and uneven dispatch that
every rank agrees on."""

from __future__ import annotations

import pytest

from tests.conftest import cluster, gpt
from twin.schedule.builder import build_schedule
from twin.schedule.check import check_schedule
from twin.spec import ParallelPlan, build_job
from twin.spec.experts import expert_grid
from twin.spec.moe import MoESpec
from twin.vocab import wire_factor
from twin.workload.params import expert_params, stage_params

H, S, E, K, FE = 256, 128, 8, 2, 512


def moe_model(**moe) -> object:
    spec = dict(num_experts=E, experts_per_token=K, moe_ffn_hidden_size=FE, first_k_dense=1)
    spec.update(moe)
    return gpt(num_layers=4, activation="swiglu", moe=MoESpec(**spec))


def job(model=None, gpus=4, **plan):
    return build_job(model or moe_model(), cluster(gpus=gpus), ParallelPlan(**plan))


def ops(j, rank, pred):
    return [op for op in build_schedule(j).program(rank).ops if pred(op)]


def test_uniform_all_to_all_bytes_closed_form():
    # per MoE layer and micro-batch: dispatch and combine forward, their mirrors backward,
    # each moving tokens x top-k x h x dtype bytes, (ep-1)/ep of it off the rank
    ep, e = 4, 2
    a2a = ops(job(ep=ep), 0, lambda op: op.kind == "all_to_all")
    moe_layers = 3  # 4 layers, the first dense
    assert len(a2a) == 4 * moe_layers
    size = S * K * H * e
    assert {op.bytes for op in a2a} == {size}
    assert all(not op.send_splits and op.group == (0, 1, 2, 3) for op in a2a)
    assert sum(op.bytes * wire_factor("all_to_all", ep) for op in a2a) == \
        4 * moe_layers * size * (ep - 1) / ep
    names = [op.name.split("/")[-1] for op in a2a if "/L1/" in op.name]
    assert names == ["moe.dispatch", "moe.combine", "moe.combine.bwd", "moe.dispatch.bwd"]


def test_grouped_gemm_flops_closed_form():
    # uniform: every EP rank receives tokens*k copies; fc1 (gate+up) 2*R*2fe*h, fc2 2*R*h*fe
    j = job(ep=4)
    r = S * K
    fwd = {op.name.split("/")[-1]: op for op in ops(j, 2, lambda op: op.phase == "fwd"
                                                       and "/L2/experts." in op.name)}
    assert fwd["experts.fc1"].shape == (r, 2 * FE, H)
    assert fwd["experts.fc1"].flops + fwd["experts.fc2"].flops == 6 * r * H * FE
    router = ops(j, 2, lambda op: op.name == "fwd/mb0/L2/router")[0]
    assert router.flops == 2 * S * H * E


def test_skewed_routing_conserves_tokens_and_splits_agree():
    model = moe_model(routing="skewed", routing_skew=0.7, routing_seed=3)
    j = job(model, ep=4)
    sched = build_schedule(j)
    progs = sched.programs()
    check_schedule(progs)  # collective order, sizes, deadlock freedom
    rows = {}
    for layer in (1, 2, 3):
        got = [op.shape[0] for r in range(4) for op in progs[r].ops
               if op.name == f"fwd/mb0/L{layer}/experts.fc1"]
        assert sum(got) == 4 * S * K and len(set(got)) > 1  # uneven, nothing lost
    for r, p in progs.items():
        for op in p.ops:
            if op.kind == "all_to_all":
                assert op.send_splits and sum(op.recv_splits) > 0
                rows[(op.name, r)] = op
    for (name, a), op in rows.items():  # what a receives from b is what b sends a
        for j_, b in enumerate(op.group):
            assert op.recv_splits[j_] == rows[(name, b)].send_splits[op.group.index(a)]
    # deterministic: the same seed, the same programs
    again = build_schedule(job(moe_model(routing="skewed", routing_skew=0.7, routing_seed=3),
                               ep=4))
    assert again.program(1).ops == progs[1].ops


def test_expert_gradients_reduce_over_expert_data_parallel_group():
    # ep=2 on dp=4: experts held by ranks {0, 2} and {1, 3}; EP groups {0, 1}, {2, 3}
    j = job(ep=2)
    grid = expert_grid(j.grid, j.parallel)
    assert grid.group(0, "ep") == (0, 1) and grid.group(0, "edp") == (0, 2)
    e = 2
    colls = ops(j, 0, lambda op: op.is_collective)
    expert = [op for op in colls if op.group_name == "edp"]
    dense = [op for op in colls if op.group_name == "dp"]
    assert expert and all(op.group == (0, 2) and op.kind == "all_reduce" for op in expert)
    experts_bytes = 3 * expert_params(j.model, 2, 1) * e
    assert sum(op.bytes for op in expert) == experts_bytes
    assert sum(op.bytes for op in dense) == stage_params(j, 0) * e - experts_bytes
    assert all(op.group == (0, 1, 2, 3) for op in dense)


def test_clipping_sums_the_experts_squares_over_their_own_group_after_the_dense_ones():
    """Each EP rank holds other experts, so the global norm needs their squares summed over
    etp x ep x pp (Megatron's expert optimizer, combined as sqrt(d^2 + e^2)); without it each
    rank would clip by its own norm and the dense replicas drift apart."""
    def norms(j, rank):
        return [(op.name.split("/")[-1], op.group, op.group_name, op.bytes)
                for op in ops(j, rank, lambda op: op.is_collective and op.phase == "opt")]

    assert norms(job(ep=2), 3) == [("expert.grad_norm.ar", (2, 3), "etp-ep-pp", 4.0)]
    assert norms(job(gpus=8, tp=2, sp=True, ep=2, etp=1), 0) == [
        ("grad_norm.ar", (0, 1), "tp-pp", 4.0), ("expert.grad_norm.ar", (0, 1), "etp-ep-pp", 4.0)]
    z1 = norms(job(ep=2, zero_stage=1), 0)  # ZeRO adds dp to the dense norm, edp to the experts'
    assert [(n, g) for n, g, _, _ in z1 if "norm" in n] == [
        ("grad_norm.ar", (0, 1, 2, 3)), ("expert.grad_norm.ar", (0, 1, 2, 3))]
    assert norms(job(), 0) == []  # ep=1, etp=tp: the experts are dense parameters


def test_zero2_reduce_scatters_and_gathers_experts_over_edp():
    j = job(ep=2, zero_stage=2)
    kinds = {(op.group_name, op.kind) for op in ops(j, 1, lambda op: op.is_collective)}
    assert {("edp", "reduce_scatter"), ("edp", "all_gather")} <= kinds


def test_expert_tensor_parallel_gathers_over_etp():
    # tp=2 with SP, etp=2 (= tp), ep=2 on 8 GPUs: tokens s/t per rank, dispatched over EP,
    # gathered over ETP (the TP pair) before the experts, reduce-scattered after
    j = job(gpus=8, tp=2, sp=True, ep=2)
    grid = expert_grid(j.grid, j.parallel)
    assert grid.group(0, "etp") == (0, 1) and grid.group(0, "ep") == (0, 2)
    e, n = 2, S // 2
    fwd = {op.name.split("/")[-1]: op for op in ops(j, 0, lambda op: "fwd/mb0/L1/" in op.name)}
    assert fwd["moe.dispatch"].bytes == n * K * H * e
    assert fwd["moe.ag"].group_name == "etp" and fwd["moe.ag"].bytes == n * K * 2 * H * e
    assert fwd["experts.fc1"].shape == (n * K * 2, 2 * FE // 2, H)
    assert fwd["moe.rs"].kind == "reduce_scatter"


def test_ep1_experts_ride_the_dense_groups():
    # ep=1, etp=tp: the experts are replicated like dense weights; DDP reduces them with the
    # rest over DP, and FSDP shards them with their layer
    j = job(zero_stage=0)
    colls = ops(j, 0, lambda op: op.is_collective)
    assert not [op for op in colls if op.group_name in ("ep", "edp")]
    assert sum(op.bytes for op in colls if op.group_name == "dp") == stage_params(j, 0) * 2
    fsdp = job(zero_stage=3)
    assert build_schedule(fsdp).program(0).ops


def test_shared_experts_run_as_a_tp_mlp():
    j = job(moe_model(shared_experts=2), gpus=4, tp=2, sp=True, ep=2)
    fwd = {op.name.split("/")[-1]: op for op in ops(j, 0, lambda op: "fwd/mb0/L3/" in op.name)}
    assert fwd["shared.fc_gate"].shape == (S, 2 * FE // 2, H)
    assert fwd["shared.ag"].kind == "all_gather" and fwd["shared.rs"].kind == "reduce_scatter"


@pytest.mark.parametrize("plan, message", [
    (dict(ep=3), "parallel.ep=3 does not divide model.moe.num_experts=8"),
    (dict(ep=8), "ep * etp = 8 * 1 = 8 must divide the tp * cp * dp = 1 * 1 * 4 = 4 ranks"),
    (dict(ep=2, tp=2), "needs sequence parallelism"),
    (dict(ep=2, zero_stage=3), "zero_stage=3 with ep=2"),
    (dict(etp=3, tp=1), "etp=3 does not divide model.moe.moe_ffn_hidden_size=512"),
])
def test_expert_plan_errors(plan, message):
    from twin.spec import ConfigError

    with pytest.raises(ConfigError, match=message.replace("*", r"\*")):
        job(**plan)


def test_ep_on_a_dense_model_is_an_error():
    from twin.spec import ConfigError

    with pytest.raises(ConfigError, match=r"parallel.ep=2 needs a mixture-of-experts model"):
        job(gpt(), ep=2)


@pytest.mark.parametrize("shared, skew", [(0, 0.0), (2, 0.6)])
@pytest.mark.parametrize("plan", [
    dict(ep=4), dict(ep=2, zero_stage=2), dict(gpus=8, tp=2, sp=True, ep=2), dict(tp=2),
    dict(zero_stage=3), dict(gpus=8, tp=2, sp=True, ep=2, etp=1, zero_stage=1),
    dict(ep=2, recompute="full"), dict(ep=2, recompute="full", recompute_early_stop=True),
    dict(gpus=8, tp=2, sp=True, ep=2, recompute="full", recompute_early_stop=True),
    dict(tp=2, recompute="full", recompute_early_stop=True)])
def test_inspect_closed_forms_equal_the_schedule(shared, skew, plan):
    """`paratwin inspect`'s per-group bytes and executed FLOPs (twin/workload/moerank.py)
    are the schedule's own, rank by rank, under every expert layout."""
    from twin.workload.moerank import moe_step_traffic
    from twin.workload.summary import rank_flops_per_step

    model = moe_model(shared_experts=shared, routing="skewed" if skew else "uniform",
                      routing_skew=skew)
    j = job(model, **plan)
    for rank in (0, j.grid.world_size - 1):
        prog = build_schedule(j).program(rank)
        got: dict[str, float] = {}
        for c in prog.summary()["collectives"]:
            # the 4-byte gradient norms (dense, and the experts' own: step.py)
            if c["group"] not in ("tp-pp", "tp-pp-dp", "etp-ep-pp", "etp-ep-edp-pp"):
                got[c["group"]] = got.get(c["group"], 0.0) + c["bytes"]
        want = {k: g.bytes for k, g in moe_step_traffic(j, rank).items()}
        assert want == pytest.approx(got)
        kernels = sum(op.flops for op in prog.ops if op.kind in ("gemm", "attention"))
        if plan.get("recompute") != "full":  # (dense layers differ there by their attention
            # backward's count under full recompute, a gap of the dense closed form)
            assert rank_flops_per_step(j, rank) == pytest.approx(kernels, rel=1e-12)


def test_an_early_stopping_recomputation_runs_a_moe_layer_whole():
    """PyTorch's non-reentrant checkpoint stops once every saved tensor is recomputed: in a
    dense layer before fc2, in a MoE layer after its experts' weighted combine (which saves
    their outputs), so the routed experts' fc2 and both all-to-alls are re-run; the first
    layer (first_k_dense=1) stays dense."""
    j = job(ep=2, recompute="full", recompute_early_stop=True)
    redo = {(op.layer, op.name.rsplit("/", 1)[1]) for op in build_schedule(j).program(0).ops
            if op.phase == "recompute"}
    assert (0, "act") in redo and (0, "fc2") not in redo and (0, "resid2") not in redo
    for layer in range(1, j.model.num_layers):
        assert {(layer, "experts.fc2"), (layer, "moe.combine"), (layer, "moe.unpermute")} <= redo
        assert (layer, "resid2") not in redo
    whole = {(op.layer, op.name.rsplit("/", 1)[1]) for op in build_schedule(
        job(ep=2, recompute="full")).program(0).ops if op.phase == "recompute"}
    assert whole - redo == {(0, "fc2"), (0, "resid2")} | {(L, "resid2") for L in range(1, 4)}


@pytest.mark.parametrize("preset", ["fsdp", "hsdp"])
def test_the_fsdp_presets_build_a_moe_model(preset):
    """The fsdp and hsdp presets run PyTorch's full AC with its early stop; a MoE model under
    them builds (it was refused once) and its step checks out."""
    from tests.schedule.helpers import preset_job

    j = preset_job(preset, "mixtral_8x7b", "dgx_h100", 8, "model.num_layers=2",
                   "parallel.global_batch_size=8")
    assert j.parallel.recompute_early_stop and j.model.moe is not None
    assert check_schedule(build_schedule(j).programs())["ops"] > 0


def test_fp8_sp_gathers_of_a_moe_model_are_the_closed_form():
    """Float8 tensorwise under SP gathers the dense inputs in FP8 (TensorParallel.fp8_gather);
    a MoE layer's MLP gathers are gone from the TP count at the bytes they had."""
    import dataclasses

    from twin.workload.moerank import moe_step_traffic

    c = cluster(gpus=8)
    c = dataclasses.replace(c, gpu=dataclasses.replace(
        c.gpu, peak_tflops={**c.gpu.peak_tflops, "fp8": 2 * c.gpu.peak_tflops["bf16"]}))
    for recompute in ("none", "full"):
        j = build_job(moe_model(), c, ParallelPlan(tp=2, sp=True, ep=2, float8="tensorwise",
                                                   recompute=recompute))
        prog = build_schedule(j).program(0)
        got = sum(c_["bytes"] for c_ in prog.summary()["collectives"] if c_["group"] == "tp")
        assert moe_step_traffic(j, 0)["tp"].bytes == pytest.approx(got)
