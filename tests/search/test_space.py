"""The search space: only plans build_job accepts, each once, and none of a brute-force
product missed."""

from __future__ import annotations

import dataclasses
import itertools
import warnings

import pytest

from tests.conftest import cluster
from twin.search.space import (
    SearchSpace,
    canonical,
    canonical_order,
    gpu_counts,
    memory_plans,
    orders_for,
    plans,
)
from twin.spec import ConfigError, ModelSpec, ParallelPlan, RankGrid, build_job
from twin.spec.moe import MoESpec
from twin.spec.parallel import PP_SCHEDULES, RECOMPUTE

TINY = ModelSpec(name="tiny", num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2,
                 ffn_hidden_size=128, vocab_size=512, seq_len=64, activation="swiglu",
                 dtype="bf16")
CLUSTER = cluster(nodes=1, gpus=4)
ORDERS = ["-".join(p) for p in itertools.permutations(("tp", "pp", "dp"))]


MOE = dataclasses.replace(TINY, name="tiny_moe", moe=MoESpec(
    num_experts=4, experts_per_token=2, moe_ffn_hidden_size=64, shared_experts=1))
LONG = dataclasses.replace(TINY, name="tiny_long", seq_len=32768)
CLUSTER8 = cluster(nodes=2, gpus=4)


def _accepted(plan: ParallelPlan, model: ModelSpec = TINY,
              cl=CLUSTER) -> ParallelPlan | None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return build_job(model, cl, plan).parallel
        except (ConfigError, ValueError):
            return None


def brute_force(gbs: int) -> dict[str, set[ParallelPlan]]:
    """Every combination of the searched fields build_job accepts, canonicalized, by the
    recompute value it was built from (the search's default space leaves op-level SAC out)."""
    out = {rc: set() for rc in RECOMPUTE}
    for tp, pp, mb, sched, v, sp, zero, reshard, rc, order in itertools.product(
            range(1, 5), range(1, 5), range(1, gbs + 1), PP_SCHEDULES, (1, 2), (False, True),
            range(4), (True, False), RECOMPUTE, ORDERS):
        if 4 % (tp * pp):
            continue  # build_job would refuse: tp * pp must divide the 4 GPUs
        try:
            plan = ParallelPlan(tp=tp, pp=pp, micro_batch_size=mb, global_batch_size=gbs,
                                pp_schedule=sched, pp_virtual_stages=v, sp=sp, zero_stage=zero,
                                fsdp_reshard_after_forward=reshard, recompute=rc,
                                rank_order=order)
        except (ConfigError, ValueError):
            continue
        resolved = _accepted(plan)
        if resolved is not None:
            out[rc].add(canonical(resolved))
    return out


@pytest.mark.filterwarnings("ignore")  # legal plans that warn (1F1B fill/drain) count too
@pytest.mark.parametrize("gbs", [4, 8])
def test_enumeration_is_the_brute_force_space_each_plan_once(gbs):
    space = SearchSpace(gpus=(4,), global_batch_size=gbs)
    listed = list(plans(TINY, 4, space))
    assert len(listed) == len(set(listed)), "a plan is listed twice"
    by_recompute = brute_force(gbs)  # (one pass over the product for both spaces)
    assert set(listed) == set().union(*(by_recompute[rc] for rc in RECOMPUTE if rc != "op"))
    every = list(plans(TINY, 4, SearchSpace(gpus=(4,), global_batch_size=gbs, recompute=RECOMPUTE)))
    assert set(every) == set().union(*by_recompute.values()) > set(listed)  # op where modelled


def test_every_enumerated_plan_is_accepted_and_canonical():
    space = SearchSpace(gpus=(4,), global_batch_size=8)
    for plan in plans(TINY, 4, space):
        resolved = _accepted(plan)
        assert resolved == plan, f"build_job refuses or changes {plan}"
        assert canonical(plan) == plan


def test_equivalent_rank_orders_build_the_same_grid():
    """Two orders share a canonical spelling exactly when they place every rank alike."""
    sizes = {"tp": 2, "pp": 1, "dp": 4}
    grids = {}
    for order in ("-".join(p) for p in itertools.permutations(("tp", "cp", "pp", "dp"))):
        grid = RankGrid.build(dp=4, tp=2, pp=1, order=order.split("-"), gpus_per_node=4)
        placed = tuple(tuple(sorted(grid.coords(r).items())) for r in range(8))
        grids.setdefault(canonical_order(order, sizes), set()).add(placed)
    assert all(len(p) == 1 for p in grids.values())
    assert len({next(iter(p)) for p in grids.values()}) == len(grids) == 2
    assert orders_for(sizes, None) == ["tp-cp-pp-dp", "dp-cp-pp-tp"]


def test_a_narrowed_space_keeps_only_the_choices_given():
    space = SearchSpace(gpus=(4,), global_batch_size=8, tp=(2,), zero_stage=(3,),
                        recompute=("full",), pp_schedule=("1f1b",))
    listed = list(plans(TINY, 4, space))
    assert listed and all(p.tp == 2 and p.recompute == "full" for p in listed)
    assert all(p.zero_stage == 3 or p.dp == 1 for p in listed)  # dp = 1: ZeRO is ZeRO-0
    assert all(p.pp == 1 or p.pp_schedule == "1f1b" for p in listed)
    assert len(list(memory_plans(TINY, 4, space))) <= len(listed)


def test_gpu_counts_are_whole_nodes_or_part_of_one():
    c = cluster(nodes=1, gpus=8)
    assert gpu_counts(c, 1, 64) == [1, 2, 4, 8, 16, 32, 64]
    assert gpu_counts(c, 16, 48) == [16, 32, 48]
    assert gpu_counts(c, 9, 15) == []


NEW = {"ep": (1, 2, 4), "etp": (None, 1, 2, 4), "cp": (1, 2, 4, 8), "dp_replicate": (1, 2, 4, 8)}
"""The expert, context and HSDP fields, brute-forced beside the others (fixed schedule)."""


def brute_force_new(model: ModelSpec, gpus: int, gbs: int, method: str) -> set[ParallelPlan]:
    """Every combination of tp, pp, sp, ZeRO, reshard, ep, etp, cp, dp_replicate (one
    micro-batch size, 1F1B, no recompute, the default order) build_job accepts."""
    cl = cluster(nodes=gpus // 4, gpus=4)
    out = set()
    for tp, pp, cp, sp, zero, reshard, ep, etp, rep in itertools.product(
            (1, 2, 4), (1, 2), NEW["cp"], (False, True), range(4), (True, False), NEW["ep"],
            NEW["etp"], NEW["dp_replicate"]):
        if gpus % (tp * pp * cp):
            continue
        try:
            plan = ParallelPlan(tp=tp, pp=pp, cp=cp, cp_method=method, sp=sp, zero_stage=zero,
                                ep=ep, etp=etp,
                                dp_replicate=rep, fsdp_reshard_after_forward=reshard,
                                micro_batch_size=1, global_batch_size=gbs)
        except (ConfigError, ValueError):
            continue
        resolved = _accepted(plan, model, cl)
        if resolved is not None:
            out.add(canonical(resolved))
    return out


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("model,method", [(MOE, "ring"), (LONG, "ring"), (LONG, "alltoall")],
                         ids=["moe", "long_sequence_ring", "long_sequence_ulysses"])
def test_expert_context_and_hsdp_fields_are_the_brute_force_space(model, method):
    """ep / etp on a MoE model, cp at a long sequence (the base plan's cp_method: Ulysses
    splits the heads), dp_replicate under ZeRO-3: the enumeration is exactly what build_job
    accepts, each plan once."""
    space = SearchSpace(gpus=(8,), global_batch_size=8, gpus_per_node=4, micro_batch_size=(1,),
                        base=ParallelPlan(cp_method=method),
                        pp=(1, 2), pp_schedule=("1f1b",), recompute=("none",),
                        rank_order=("tp-cp-pp-dp",), ep=NEW["ep"], etp=(1, 2, 4),
                        cp=NEW["cp"], dp_replicate=NEW["dp_replicate"])
    listed = list(plans(model, 8, space))
    assert len(listed) == len(set(listed)), "a plan is listed twice"
    want = brute_force_new(model, 8, 8, method)
    assert set(listed) == want
    field = "ep" if model.moe else "cp"
    assert {getattr(p, field) for p in listed} > {1}
    assert any(p.dp_replicate > 1 for p in listed) and any(p.etp == 1 for p in listed) \
        == (model.moe is not None)


def test_default_space_tries_cp_only_at_long_sequences_and_hsdp_by_node_size():
    space = SearchSpace(gpus=(8,), global_batch_size=8, gpus_per_node=4)
    short = list(memory_plans(TINY, 8, space))
    assert {p.cp for p in short} == {1}
    assert {p.dp_replicate for p in short if p.zero_stage == 3 and p.dp == 8} == {1, 2}
    assert {p.dp_replicate for p in short if p.zero_stage == 3 and p.dp == 4} == {1}
    assert {p.cp for p in memory_plans(LONG, 8, space)} == {1, 2, 4, 8}
    moe = list(memory_plans(MOE, 8, space))
    assert {p.ep for p in moe} == {1, 2, 4}
    assert {p.expert_tp for p in moe if p.tp == 2} == {1, 2}  # etp in {1, tp}
