"""torch.compile's scope: torchtitan compiles each transformer block (apply_compile), so the
elementwise ops outside the blocks (the embedding, final norm, loss and their backward, the
step end's gradient clipping) run eager whether parallel.compile is on or not. They carry
Op.outside_blocks, and a compiled cost model prices them as the eager one does; the host's
plan times every op as CostModel.host_time does (its memo keys on what that depends on)."""

from __future__ import annotations

import dataclasses

import pytest

from tests.conftest import cluster, gpt
from twin.cost import CostModel
from twin.schedule.builder import build_schedule
from twin.sim.host import host_plan
from twin.spec import GPUSpec, ParallelPlan, build_job

H100 = GPUSpec(name="H100", peak_tflops={"bf16": 989.0, "fp8": 1979.0, "fp32": 67.0})
OUTSIDE = {"embed", "embed.bwd", "final_norm", "final_norm.bwd", "loss", "loss.bwd", "grad_norm", "clip"}


def _ops(**plan):
    base = dict(zero_stage=3, compile=True, global_batch_size=8)
    base.update(plan)
    job = build_job(gpt(), dataclasses.replace(cluster(), gpu=H100), ParallelPlan(**base))
    return build_schedule(job).program(0).ops


def _local(op) -> str:
    return op.name.rsplit("/", 1)[1]


def _h100_profile() -> CostModel:
    from paratwin.config import CONF_DIR

    return CostModel.load(CONF_DIR / "profiles" / "dgx_h100.yaml")


@pytest.mark.parametrize("plan", [{}, dict(zero_stage=0, tp=2, sp=True, recompute="full"),
                                  dict(zero_stage=1, pp=2, recompute="selective")])
def test_the_ops_outside_the_blocks_are_the_embedding_head_and_step_end(plan):
    ops = _ops(**plan)
    outside = {_local(op) for op in ops if op.outside_blocks}
    assert outside <= OUTSIDE and {"embed", "grad_norm", "clip"} <= outside
    for op in ops:
        if op.outside_blocks:
            assert op.layer < 0 and not op.one_kernel and op.kind == "elementwise"
        elif op.kind == "elementwise" and op.layer < 0:  # FSDP2's copies (one kernel in
            # eager PyTorch too) and the loss, compiled with the blocks (compile_loss)
            assert op.one_kernel or _local(op) in ("loss", "loss.bwd")
    # the flag keeps the reduction's: the final norm and the loss still reduce along rows
    assert all(op.reduction for op in ops if _local(op) in ("final_norm", "loss"))


def test_compile_leaves_the_ops_outside_the_blocks_eager():
    """t = launch + bytes / (HBM * eff): eff the eager profile's elementwise memory efficiency
    outside the blocks (no eager factor taken out, no reduction share), the fused one times
    compiled_reduction_efficiency for the norms inside them."""
    eager = _h100_profile()
    fused = eager.compiled()
    f, r = eager.eager_elementwise, eager.compiled_reduction_efficiency
    assert f > 3 and r < 1
    ops = _ops(compile_loss=False)  # torchtitan's December 2024 scope: the blocks only
    hbm = H100.hbm_bw_GBps * 1e9
    k = eager.elementwise
    for op in ops:
        if op.outside_blocks:
            assert fused.compute_time(op, H100) == eager.compute_time(op, H100)
            assert fused.host_time(op) == eager.host_time(op) == pytest.approx(k.host_us * 1e-6)
    loss = next(op for op in ops if _local(op) == "loss")
    assert fused.compute_time(loss, H100) == pytest.approx(
        k.launch_us * 1e-6 + max(loss.flops / (H100.peak_flops("bf16") * k.efficiency),
                                 loss.bytes / (hbm * k.mem_efficiency)))
    # the same norm inside a block: fused, at r of the fused bandwidth
    norm = next(op for op in ops if _local(op) == "norm1")
    final = next(op for op in ops if _local(op) == "final_norm")
    inside = dataclasses.replace(final, shape=norm.shape)
    assert inside.reduction and not inside.outside_blocks
    assert fused.kernel_of(inside).mem_efficiency == pytest.approx(
        min(1.0, k.mem_efficiency * f) * r)
    assert fused.compute_time(inside, H100) < fused.compute_time(final, H100)


def test_a_compiled_model_writes_the_profile_it_came_from_less_the_eager_model():
    eager = _h100_profile()
    fused = eager.compiled()
    data = fused.to_dict()
    assert "eager_model" not in data
    back = CostModel.from_dict(data)
    assert back == fused and back.eager_model is None
    assert fused.compiled() is fused and fused.eager_model is eager


def test_the_hosts_plan_times_every_op_as_host_time_does():
    """The plan prices the host per op signature (twin.sim.codes): FSDP2's copies (one kernel), the layers'
    ops and the ops outside the blocks each keep their own (a copy first must not set the
    price of every elementwise op after it)."""
    eager = _h100_profile()
    for cost in (eager, eager.compiled()):
        ops = _ops()
        plan = host_plan(ops, cost)
        issue = [plan.issue_s[0]] + [b - a for a, b in zip(plan.issue_s, plan.issue_s[1:])]
        assert issue == pytest.approx([cost.host_time(op) for op in ops], rel=1e-9, abs=1e-15)
        prices = {cost.host_time(op) for op in ops if op.kind == "elementwise"}
        assert len(prices) >= 2


def test_a_compiled_loss_is_inside_the_compiled_region():
    """compile_loss (default: torchtitan compiles the loss with the blocks since 2025): the
    loss and its backward are fused; false (torchtitan's December 2024 runs) leaves them eager
    with the rest outside the blocks."""
    compiled = {_local(op) for op in _ops() if op.outside_blocks}
    blocks_only = {_local(op) for op in _ops(compile_loss=False) if op.outside_blocks}
    assert blocks_only - compiled == {"loss", "loss.bwd"}
    eager = _h100_profile()
    fused = eager.compiled()
    loss = next(op for op in _ops() if _local(op) == "loss")
    assert loss.reduction and fused.compute_time(loss, H100) < eager.compute_time(loss, H100)


def test_the_head_keeps_what_the_compiled_loss_saves():
    """The schedule's head activation buffer holds the final norm's and the head's inputs and
    what the loss saves: the fp32 log-softmax eager, the logits and a log-sum-exp per token
    compiled (twin.workload.loss.saved_logits_bytes, the static memory model's term)."""
    for compile_loss, logits in ((False, lambda sb, v, e: 4 * sb * v),
                                 (True, lambda sb, v, e: e * sb * v + 4 * sb)):
        job = build_job(gpt(), dataclasses.replace(cluster(), gpu=H100),
                        ParallelPlan(compile=True, compile_loss=compile_loss, global_batch_size=8))
        m, ops = job.model, build_schedule(job).program(0).ops
        sb = m.seq_len * job.parallel.micro_batch_size
        h, v, e = m.hidden_size, m.vocab_size, m.dtype_bytes
        head = next(op for op in ops if op.kind == "alloc" and op.tag.startswith("act.head.mb0"))
        assert head.bytes == 2 * e * sb * h + logits(sb, v, e)


def test_the_hosts_plan_prices_fsdp_calls_apart_from_their_groups_other_calls():
    """call_role reads an op's paradigm (FSDP2's gathers and reduce-scatters are priced as
    ``fsdp``, not as their group's): a call of the same kind on the same group outside FSDP
    keeps its own host time in the memoized plan."""
    from twin.schedule.ir import Op

    cost = dataclasses.replace(_h100_profile(), host_comm_by_group_us={"fsdp": 50.0, "dp": 10.0})
    group = (0, 1)
    ops = [Op(f"{p or 'zero'}.ag", "all_gather", "comm", group=group, group_name="dp",
              paradigm=p, bytes=1e6) for p in ("fsdp", "zero")]
    for order in (ops, ops[::-1]):
        plan = host_plan(order, cost)
        issue = [plan.issue_s[0], plan.issue_s[1] - plan.issue_s[0]]
        assert issue == pytest.approx([cost.host_time(op) for op in order], rel=1e-9)
        assert issue[0] != pytest.approx(issue[1])
