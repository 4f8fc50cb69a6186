"""A MoE model with plain-PyTorch expert parallelism against the schedule, on gloo ranks.

The conformance model's MoE layers (executor/conformance/moe.py) dispatch and combine with
all_to_all_single under the twin's forced routing, so every all-to-all's per-peer bytes are
the schedule's; the experts' gradients go over the expert-data-parallel group and the
dense ones through DDP. The last of 3 steps must equal the schedule call by call (count,
bytes, order, all-to-all splits), and the losses the single-process run's (the same
forced routing over the whole batch) to 1e-5 relative.
"""

from __future__ import annotations

import json

import pytest

from tests.conformance.test_compare import tiny
from tests.conftest import cluster
from twin.spec import ConfigError, ParallelPlan, build_job
from twin.spec.moe import MoESpec

torch = pytest.importorskip("torch")

from executor.conformance.model import build_model, loss_fn, make_batch  # noqa: E402
from executor.conformance.moe import forced_routing, route_in_blocks, routed_tokens  # noqa: E402
from executor.conformance.parallelize import check_plan  # noqa: E402
from executor.conformance.rank import result_path  # noqa: E402
from executor.conformance.runner import conform  # noqa: E402
from executor.conformance.train import clip, optimizer, step_batch  # noqa: E402
from twin.workload.moe import tokens_per_expert, traffic  # noqa: E402

SKEWED = dict(routing="skewed", routing_skew=0.5, routing_seed=1)


def moe_tiny(**kw):
    base = dict(num_experts=4, experts_per_token=2, moe_ffn_hidden_size=64, shared_experts=1,
                first_k_dense=1, **SKEWED)
    return tiny(moe=MoESpec(**{**base, **kw}))


PLANS = {  # name: (world size, plan, model overrides)
    "ep2": (2, dict(ep=2), {}),
    "ep2_accum": (2, dict(ep=2, global_batch_size=4), {}),  # 2 micro-batches: experts' grads
    "ep2_edp2": (4, dict(ep=2), {}),
    "ep4": (4, dict(ep=4, etp=1), dict(capacity_factor=1.0, router_aux_loss=False,
                                       shared_experts=0)),
}


def _job(world: int, plan: dict, **model):
    return build_job(moe_tiny(**model), cluster(gpus=world), ParallelPlan(**plan))


def reference_grad_norms(job, seed: int, steps: int) -> list[float]:
    """The single-process run's global gradient norm at each step (train.reference_losses'
    recipe). AdamW hardly sees a gradient's scale, so the losses alone would miss a wrong
    1 / dp on the experts; the norm does not."""
    model = build_model(job.model, seed)
    route_in_blocks(model, routed_tokens(job))
    opt, out = optimizer(model.parameters()), []
    for step in range(steps):
        x, y = step_batch(job, seed, step)
        loss_fn(model(x), y).backward()
        out.append(clip(model.named_parameters()))
        opt.step()
        opt.zero_grad()
    return out


def test_forced_routing_gives_each_expert_the_routing_models_count_once_per_token():
    moe = moe_tiny(capacity_factor=1.0).moe
    for layer in (1, 2, 3):
        experts, kept = forced_routing(moe, layer, 64)
        assert all(len(set(row)) == moe.experts_per_token for row in experts.tolist())
        got = torch.bincount(torch.from_numpy(experts[kept]), minlength=4).tolist()
        assert tuple(got) == tokens_per_expert(moe, layer, 64)
        # per EP peer, what the schedule's all-to-all sends (capacity drops included)
        t = traffic(moe, layer, 64, 2, 0)
        assert [got[0] + got[1], got[2] + got[3]] == list(t.send)
    assert kept.sum() < kept.size  # the capacity dropped copies somewhere


def test_routing_in_blocks_is_routing_each_block_alone():
    """The single-process reference routes the batch in the ranks' blocks: its output on
    two sequences equals the outputs of each routed alone (what two ranks compute)."""
    model = build_model(moe_tiny(), seed=0)
    x, _ = make_batch(model.spec, 2, 0)
    route_in_blocks(model, 64)
    with torch.no_grad():
        both = model(x)
        apart = torch.cat([model(x[:1]), model(x[1:])])
    assert torch.allclose(both, apart, atol=1e-6)
    route_in_blocks(model, 128)  # one block of both: another assignment, another output
    with torch.no_grad():
        assert not torch.allclose(model(x), both, atol=1e-4)
    assert float(loss_fn(both, _)) > 0


def test_an_uneven_all_to_all_counts_the_ranks_own_buffer_and_compares_its_splits():
    """The IR's all-to-all ``bytes`` is the members' mean send buffer; PyTorch's call moves
    the rank's own (sum of its send splits), and its per-peer bytes must be the schedule's."""
    from executor.conformance.compare import compare, ir_entries, torch_entries
    from twin.schedule.builder import build_schedule

    job = _job(2, dict(ep=2))
    ir = [e for e in ir_entries(build_schedule(job).program(1)) if e.kind == "all_to_all"]
    combine = [o for o in build_schedule(job).program(1).ops if o.kind == "all_to_all"][1]
    assert ir[1].bytes == sum(combine.send_splits) != combine.bytes  # it got 2 x 59 of 128
    calls = [{"step": 0, "kind": "all_to_all", "group": [0, 1], "peer": -1, "bytes": e.bytes,
              "send_splits": list(e.splits[0]), "recv_splits": list(e.splits[1])} for e in ir]
    assert compare(job, 1, ir, torch_entries(calls, 0, 1)) == []
    calls[0]["send_splits"] = calls[0]["send_splits"][::-1]  # same bytes, other peers
    (d,) = compare(job, 1, ir, torch_entries(calls, 0, 1))
    assert (d.what, d.kind, d.rule) == ("splits", "all_to_all", "")


def test_plans_the_moe_model_cannot_run_are_refused_with_their_fix():
    with pytest.raises(ConfigError, match=r"parallel.zero_stage=3 with a MoE model"):
        check_plan(_job(2, dict(zero_stage=3)))
    with pytest.raises(ConfigError, match=r"more than top-k can"):
        check_plan(build_job(moe_tiny(experts_per_token=3, routing_skew=0.9, routing_seed=0),
                             cluster(gpus=2), ParallelPlan(ep=2)))


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", PLANS)
def test_pytorch_expert_parallelism_issues_what_the_schedule_says_and_trains_alike(name, tmp_path):
    world, plan, model = PLANS[name]
    job = _job(world, plan, **model)
    res = conform(job, tmp_path / "run", steps=3, timeout_s=180, log=lambda m: None)
    assert res["differences"] == [], json.dumps(res["differences"], indent=1)
    assert res["documented"] == []
    lo = res["losses"]
    assert lo["match"], lo
    assert max(lo["relative_error"]) <= 1e-5
    for rows in res["ranks"].values():
        assert rows and all(x["ir_count"] == x["torch_count"] and x["ir_bytes"] == x["torch_bytes"]
                            for x in rows)
        a2a = [x for x in rows if x["kind"] == "all_to_all"]
        # dispatch, combine and their backward in 3 MoE layers, each micro-batch
        assert sum(x["torch_count"] for x in a2a) == 4 * 3 * job.parallel.num_microbatches
    want = reference_grad_norms(job, 0, 3)
    for r in range(world):  # every rank clips by the global norm, experts' squares included
        got = json.loads(result_path(tmp_path / "run", r).read_text())["grad_norms"]
        assert got == pytest.approx(want, rel=1e-5)
    if name == "ep2_edp2":  # the experts' gradients over edp {0, 2}, the dense over dp
        groups = {(tuple(x["group"]), x["kind"]) for x in res["ranks"]["0"]}
        assert ((0, 2), "all_reduce") in groups and ((0, 1, 2, 3), "all_reduce") in groups
