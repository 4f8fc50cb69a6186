"""Folding an expert-parallel plan is exact: fold=auto's step is fold=none's to 1e-9 on a
dozen MoE plans, simulating fewer ranks wherever a shift keeps the expert groups and each
rank's token counts (twin.schedule.builder.symmetric_shifts: under uniform routing every EP
rank of a stage, under skewed routing whole EP blocks and ETP peers); the programs derived
by translation are the ones built rank by rank; where no shift keeps them every rank is
simulated, with a note that says why."""

from __future__ import annotations

import warnings

import pytest

from tests.conftest import gpt
from twin.schedule.builder import TemplateBuilder, shifted, symmetric_shifts
from twin.schedule.step import build_program
from twin.sim.engine import SimOptions
from twin.sim.records import exact_shifts, fold_classes, fold_rep
from twin.sim.run import check_budget, estimate_work, simulate
from twin.spec import (
    ClusterSpec,
    ConfigError,
    GPUSpec,
    InterNodeSpec,
    IntraNodeSpec,
    ParallelPlan,
    build_job,
)
from twin.spec.experts import expert_grid
from twin.spec.moe import MoESpec

FULL = SimOptions(fold="none", fast_forward=False)
AUTO = SimOptions(fold="auto", fast_forward=False)


def _moe(routing: str = "uniform", skew: float = 0.0, **kw) -> MoESpec:
    base = dict(num_experts=8, experts_per_token=2, moe_ffn_hidden_size=256,
                shared_experts=1, routing=routing, routing_skew=skew)
    base.update(kw)
    return MoESpec(**base)


def _job(plan: dict, nodes: int, gpus: int, nics: int | None = None, moe: MoESpec | None = None,
         seq_len: int = 128):
    cl = ClusterSpec(name="moe", num_nodes=nodes, gpus_per_node=gpus,
                     gpu=GPUSpec(peak_tflops={"bf16": 300.0}),
                     inter=InterNodeSpec(nics_per_node=nics or gpus, nic_bw_GBps=25.0))
    model = gpt(num_layers=4, activation="swiglu", seq_len=seq_len, moe=moe or _moe())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_job(model, cl, ParallelPlan(**plan))


# plan, cluster (nodes, GPUs per node), routing, simulated ranks under fold=auto. Uniform
# routing folds every EP rank of a stage onto one; skewed routing only the moves that keep
# a rank's EP rank (whole EP blocks, ETP peers)
U, S = "uniform", "skewed"
PLANS = {
    "ep2 dp4, one node": (dict(ep=2, global_batch_size=8), (1, 4), S, 2),
    "ep4 dp8 over two nodes": (dict(ep=4, global_batch_size=8), (2, 4), U, 1),
    "ep8 = dp8 (edp 1), one node": (dict(ep=8, global_batch_size=8), (1, 8), U, 1),
    "ep4 dp8, zero1, four nodes of 2": (dict(ep=4, zero_stage=1, global_batch_size=16),
                                        (4, 2), S, 4),
    "tp2 sp, etp1 ep4 dp4": (dict(tp=2, sp=True, ep=4, etp=1, global_batch_size=8), (2, 4), U,
                             1),
    "tp2 sp, etp2 ep2 dp4": (dict(tp=2, sp=True, ep=2, etp=2, global_batch_size=8), (2, 4), S,
                             2),
    "pp2 tp2 sp, etp1 ep2 dp2, tp-cp-dp-pp": (dict(tp=2, sp=True, ep=2, etp=1, pp=2,
                                                   rank_order="tp-cp-dp-pp",
                                                   global_batch_size=8), (2, 4), U, 2),
    "pp2 ep2 dp4, 1f1b": (dict(pp=2, ep=2, global_batch_size=16), (2, 4), S, 4),
    "pp2 ep4 dp4 zero1, dp innermost": (dict(pp=2, ep=4, zero_stage=1, rank_order="dp-tp-cp-pp",
                                             global_batch_size=16), (1, 8), U, 2),
    "ep2 dp8, dp innermost over two nodes": (dict(ep=2, rank_order="dp-tp-cp-pp",
                                                  global_batch_size=16), (2, 4), S, 2),
    "tp2 sp etp1 ep8 dp4 over four nodes, zero1": (dict(tp=2, sp=True, ep=8, etp=1,
                                                        zero_stage=1, global_batch_size=8),
                                                   (4, 2), U, 1),
    "pp2 tp2 sp etp2 ep2 dp2, full recompute": (dict(pp=2, tp=2, sp=True, ep=2, etp=2,
                                                     recompute="full", global_batch_size=8),
                                                (2, 4), S, 4),
    "ep4 dp16, dp innermost over two nodes": (dict(ep=4, rank_order="dp-tp-cp-pp",
                                                   global_batch_size=16), (2, 8), U, 1),
}


def _plan_job(name: str, routing: str | None = None):
    plan, shape, default, _ = PLANS[name]
    routing = routing or default
    return _job(plan, *shape, moe=_moe(routing, 0.6 if routing == S else 0.0))


def _steps(job) -> dict[str, list[tuple[int, int]]]:
    return {a: [(s.step, s.size) for s in v] for a, v in symmetric_shifts(job).items()}


def _check_exact(job, want_ranks: int | None = None) -> dict:
    full = simulate(job, options=FULL, trace="none").summary
    auto = simulate(job, options=AUTO, trace="none").summary
    assert auto["step_time_s"] == pytest.approx(full["step_time_s"], rel=1e-9)
    assert full["simulated_ranks"] == job.grid.world_size
    if want_ranks is not None:
        assert auto["simulated_ranks"] == want_ranks
    for key in ("compute_s", "idle_s", "peak_memory_bytes"):
        for rank, value in auto[key].items():  # every representative as in the full run
            assert value == pytest.approx(full[key][rank], rel=1e-9, abs=1e-15), (key, rank)
    for group, value in full["exposed_comm_s"].items():
        assert auto["exposed_comm_s"][group] == pytest.approx(value, rel=1e-9, abs=1e-15)
    return auto


@pytest.mark.parametrize("name", PLANS)
def test_a_folded_moe_step_is_the_full_step(name):
    job = _plan_job(name)
    auto = _check_exact(job, PLANS[name][-1])
    assert auto["simulated_ranks"] < job.grid.world_size  # every plan here is symmetric
    assert not any("every rank" in n for n in auto["notes"])


@pytest.mark.parametrize("routing", [U, S])
@pytest.mark.parametrize("name", PLANS)
def test_translated_moe_programs_are_the_ones_built_rank_by_rank(name, routing):
    job = _plan_job(name, routing)
    builder = TemplateBuilder(job)
    for rank in range(job.grid.world_size):
        assert builder(job, rank).ops == build_program(job, rank).ops, rank
    copies = 1
    for shifts in symmetric_shifts(job).values():
        for shift in shifts:
            copies *= shift.size
    assert len(builder.templates) == job.grid.world_size // copies


def test_shifts_keep_expert_groups_onto_expert_groups():
    # a shift of dp by 1 with ep=4 (etp=1, tp=1) moves EP group {0..3} to {1..4}: not a
    # group; dp moves by whole EP blocks of 4 (dp innermost: stride 1)
    job = _job(dict(ep=4, rank_order="dp-tp-cp-pp", global_batch_size=8), 1, 8,
               moe=_moe("skewed", 0.5))
    assert _steps(job) == {"dp": [(4, 2)]}
    eg = expert_grid(job.grid, job.parallel)
    for rank in range(8):
        copy = fold_rep(job, "dp", rank)
        assert eg.coords(copy)["ep"] == eg.coords(rank)["ep"]
        assert [m % 4 for m in eg.group(copy, "ep")] == [m % 4 for m in eg.group(rank, "ep")]
    # uniform routing: EP ranks route alike, so dp's low digit (the EP rank) rotates inside
    # each EP group and its high digit (the EP block) moves whole groups: two shifts
    even = _job(dict(ep=4, rank_order="dp-tp-cp-pp", global_batch_size=8), 1, 8)
    assert _steps(even) == {"dp": [(1, 4), (4, 2)]}
    rotate = shifted(symmetric_shifts(even)["dp"], 0, 1)  # EP rank 0 -> 1, block kept
    assert [rotate(m) for m in range(8)] == [1, 2, 3, 0, 5, 6, 7, 4]
    assert _steps(_job(dict(ep=8, global_batch_size=8), 1, 8)) == {"dp": [(1, 8)]}
    # tp=2 with etp=1 puts TP peers in one EP group: tp moves change the EP rank
    tp = _job(dict(tp=2, sp=True, ep=2, etp=1, global_batch_size=8), 1, 8)
    assert symmetric_shifts(tp)["tp"] == (("tp", 1, 2, 1),)
    skewed = _job(dict(tp=2, sp=True, ep=2, etp=1, global_batch_size=8), 1, 8,
                  moe=_moe("skewed", 0.5))
    assert _steps(skewed) == {"dp": [(1, 4)]}  # tp peers' EP ranks differ: no tp shift


def test_skewed_routing_folds_only_moves_that_keep_each_ep_rank():
    # every source routes alike, so EP rank j of one EP group is a copy of EP rank j of the
    # others: dp (ep=2 of dp=4) folds in steps of 2, and the uneven all-to-all is exact
    job = _job(dict(ep=2, global_batch_size=8), 1, 4, moe=_moe("skewed", 0.6))
    assert any(op.send_splits for op in build_program(job, 0).ops)
    _check_exact(job, 2)
    # across nodes, the copies' uneven rows load the NICs they share with the group's
    across = _job(dict(ep=4, global_batch_size=16), 4, 4, nics=2, moe=_moe("skewed", 0.6))
    _check_exact(across, 4)
    # etp = tp: TP peers are ETP peers of one EP rank, routing alike: tp folds as well
    etp = _job(dict(tp=2, sp=True, ep=2, etp=2, global_batch_size=8), 2, 4,
               moe=_moe("skewed", 0.6))
    assert _steps(etp) == {"dp": [(2, 2)], "tp": [(1, 2)]}
    _check_exact(etp, 2)
    # on a host whose ranks share its cores, the folded copy's uneven all-to-all and its
    # compute load the same cores as the group's own: the copies' rows count there
    host = ClusterSpec(name="cpu", num_nodes=1, gpus_per_node=4, cores_per_node=2,
                       gpu=GPUSpec(peak_tflops={"bf16": 1.0}),
                       intra=IntraNodeSpec(kind="shared_cpu", bw_GBps=2.0))
    model = gpt(num_layers=2, activation="swiglu", moe=_moe("skewed", 0.6))
    cpu = build_job(model, host, ParallelPlan(ep=2, global_batch_size=4))
    assert any(op.send_splits for op in build_program(cpu, 0).ops)
    _check_exact(cpu, 2)


def test_skewed_routing_with_one_ep_group_simulates_every_rank_and_says_why():
    # ep = dp: the only moves change a rank's EP rank, whose token counts are its own
    job = _job(dict(ep=4, global_batch_size=8), 1, 4, moe=_moe("skewed", 0.5))
    auto = _check_exact(job, 4)
    assert auto["fold"] == "none"
    assert any("simulates every rank" in n and "skewed routing" in n for n in auto["notes"])
    with pytest.raises(ConfigError, match=r"fold=dp cannot fold a plan with expert parallelism "
                                          r"along dp .*skewed routing"):
        simulate(job, options=SimOptions(fold="dp"))


def test_uneven_uniform_routing_and_capacity_keep_each_ep_rank():
    # 8 tokens x top-3 = 24 copies over 16 experts: the largest remainder gives the first
    # experts one more, so EP ranks receive different counts even under uniform routing
    moe = _moe(num_experts=16, experts_per_token=3)
    job = _job(dict(ep=4, rank_order="dp-tp-cp-pp", global_batch_size=8), 1, 8, moe=moe,
               seq_len=8)
    assert _steps(job) == {"dp": [(4, 2)]}
    _check_exact(job, 4)
    # a capacity cuts every expert alike: still one program per EP rank, folded over edp
    capped = _moe("skewed", 0.7, capacity_factor=1.0)
    _check_exact(_job(dict(ep=2, global_batch_size=8), 2, 4, moe=capped), 2)


def test_links_still_bound_the_fold_of_a_moe_plan():
    # 2 NICs for 4 GPUs: moving one EP rank (stride 1) swaps the ranks sharing a NIC; an axis
    # folds when each of its shifts is exact, so dp stays whole though its EP blocks would fold
    job = _job(dict(ep=4, rank_order="dp-tp-cp-pp", global_batch_size=16), 2, 4, nics=2)
    assert symmetric_shifts(job)["dp"] == (("dp", 1, 4, 1), ("dp", 4, 2, 4))
    assert not exact_shifts(job)
    auto = _check_exact(job, 8)
    assert any("leaves dp unfolded" in n and "links" in n for n in auto["notes"])
    # EP groups of 2 are each a NIC's pair, moved a node at a time or inside it: folded,
    # though not under a flat ring across the nodes
    pairs = _job(dict(ep=2, rank_order="dp-tp-cp-pp", global_batch_size=16), 2, 4, nics=2)
    assert exact_shifts(pairs) == (("dp", 1, 2, 1), ("dp", 2, 4, 2))
    assert not exact_shifts(pairs, "ring")
    auto = _check_exact(pairs, 1)
    assert len(fold_classes(pairs, auto["fold"])) == 1


def test_a_folded_fast_forwarded_moe_pipeline_is_the_full_step():
    # 1F1B over 16 micro-batches: the folded representatives' steady state repeats as the
    # full run's does, so the forwarded step is still the full simulation's
    job = _job(dict(pp=2, ep=2, global_batch_size=64), 2, 4)
    full = simulate(job, options=FULL, trace="none").summary
    fast = simulate(job, options=SimOptions(fold="auto"), trace="none").summary
    assert fast["fast_forward"] is not None and fast["simulated_ranks"] == 2
    assert fast["step_time_s"] == pytest.approx(full["step_time_s"], rel=1e-9)


def test_the_budget_offers_fold_all_only_where_a_moe_plan_folds():
    skewed = _job(dict(ep=4, global_batch_size=8), 1, 4, moe=_moe("skewed", 0.5))
    with pytest.raises(ConfigError, match="too big to simulate") as refused:
        check_budget(skewed, "none", max_work=10)
    assert "fold=all" not in str(refused.value)  # no shift keeps its EP ranks
    even = _job(dict(ep=4, global_batch_size=8), 1, 4)
    folded = estimate_work(even, "all").units
    with pytest.raises(ConfigError, match="fold=all"):
        check_budget(even, "none", max_work=folded)
    assert estimate_work(even, "all").simulated_ranks == len(fold_classes(even, "all")) == 1
