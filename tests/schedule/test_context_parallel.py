"""Context parallelism's schedules by their invariants: per-layer traffic and attention work
equal the closed forms (twin/workload/context.py), the whole program's bytes equal
workload.comm's, programs are deadlock-free, translated templates are exact, and memory is
the activations of s/cp tokens plus the KV buffers."""

from __future__ import annotations

from collections import defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import cluster, gpt
from twin.kernelshape import timed_flops
from twin.schedule.builder import build_program, build_schedule
from twin.schedule.check import check_schedule, memory_peak
from twin.spec import ParallelPlan, build_job
from twin.workload.comm import step_traffic
from twin.workload.context import DKV_BYTES, attention_share, layer_traffic
from twin.workload.memory import rank_memory
from twin.workload.params import stage_params

METHODS = ("ring", "allgather", "alltoall")
PLANS = {
    "ddp": dict(global_batch_size=8),
    "tp": dict(tp=2, global_batch_size=4),
    "tp_sp": dict(tp=2, sp=True, global_batch_size=4),
    "pp": dict(pp=2, global_batch_size=8),
    "zero1": dict(zero_stage=1, global_batch_size=8),
    "fsdp": dict(zero_stage=3, global_batch_size=8),
    "selective": dict(recompute="selective", global_batch_size=8),
    "full": dict(tp=2, sp=True, recompute="full", global_batch_size=4),
    "3d": dict(tp=2, pp=2, sp=True, global_batch_size=4),
    "zb_h1": dict(pp=2, pp_schedule="zb_h1", global_batch_size=8),
}


def cp_job(cp=2, method="ring", balance="headtail", gpus=8, model=None, **kw):
    return build_job(model or gpt(), cluster(gpus=gpus),
                     ParallelPlan(cp=cp, cp_method=method, cp_load_balance=balance, **kw))


def _layer_calls(program, layer=0, mb=0):
    """{phase: [(kind, bytes)]} of the CP ops of one layer and micro-batch (sends only)."""
    out = defaultdict(list)
    for op in program.ops:
        if op.group_name == "cp" and op.kind != "recv" and op.layer == layer and op.mb == mb:
            out[op.phase].append((op.kind, op.bytes))
    return out


def _expand(calls):
    return sorted((k, b) for k, n, b in calls for _ in range(n))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_traffic_per_layer_equals_the_closed_form(method, cp):
    """ring: cp-1 KV sends of 2*b*(s/cp)*kv_dim*e forward; backward cp-1 more and cp fp32
    dK/dV sends. allgather: one all-gather of 2*b*s*kv_dim*e forward; backward another and a
    reduce-scatter of the fp32 dK/dV. alltoall: 4 all-to-alls each way of b*(s/cp)*width*e."""
    m = gpt(num_kv_heads=4)  # GQA: kv_dim = 4 * 32 / tp
    job = cp_job(cp, method, model=m, tp=2, global_batch_size=8)
    for rank in range(cp):  # every CP rank moves the same bytes
        got = _layer_calls(build_program(job, job.grid.rank(cp=rank)))
        fwd, bwd = layer_traffic(job.model, job.parallel)
        assert sorted(got["fwd"]) == _expand(fwd)
        assert sorted(got["bwd"]) == _expand(bwd)
    c, kv_dim = 128 // cp, 2 * 32
    if method == "ring":
        assert got["fwd"] == [("send", 2 * c * kv_dim * 2)] * (cp - 1)
        assert sorted(got["bwd"]).count(("send", 2 * c * kv_dim * DKV_BYTES)) == cp
    elif method == "allgather":
        assert got["fwd"] == [("all_gather", 2 * 128 * kv_dim * 2)]


@pytest.mark.parametrize("method", ["ring", "allgather"])
@pytest.mark.parametrize("balance", ["headtail", "none"])
@pytest.mark.parametrize("cp", [2, 4])
def test_attention_work_per_rank_follows_the_balancer(method, balance, cp):
    """The FLOPs a rank's attention kernels are timed by (a causal square at half), over
    the causal total of one layer at cp=1: headtail 1/cp each, none (2i+1)/cp^2."""
    ref = cp_job(1, gpus=1)
    total = sum(timed_flops(op) for op in build_program(ref, 0).ops
                if op.kind == "attention" and op.phase == "fwd" and op.layer == 0 and op.mb == 0)
    job = cp_job(cp, method, balance, gpus=cp)
    for i in range(cp):
        prog = build_program(job, job.grid.rank(cp=i))
        work = sum(timed_flops(op) for op in prog.ops
                   if op.kind == "attention" and op.phase == "fwd" and op.layer == 0)
        want = 1 / cp if balance == "headtail" else (2 * i + 1) / cp ** 2
        assert work / total == pytest.approx(want)
        assert attention_share(job.parallel, job.model.seq_len, i) == pytest.approx(want)
        bwd = sum(timed_flops(op) for op in prog.ops
                  if op.kind == "attention" and op.phase == "bwd" and op.layer == 0)
        assert bwd == pytest.approx(2.5 * work)  # flash backward: 2x, +0.5x recomputed scores


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", PLANS)
def test_schedule_traffic_equals_the_closed_forms(method, name):
    """Per group and kind, every rank's program moves what workload.comm says: TP/SP and PP
    on s/cp tokens, gradients over dp x cp, the CP exchange per layer (recomputed forwards
    included)."""
    job = cp_job(2, method, **PLANS[name])
    for rank in {job.grid.rank(pp=s, cp=c) for s in range(job.parallel.pp) for c in range(2)}:
        got = defaultdict(float)
        for op in build_program(job, rank).ops:
            if (op.is_collective or op.kind == "send") and not op.name.endswith("grad_norm.ar"):
                got[(op.group_name, op.kind)] += op.bytes  # (clipping's 4 bytes not modelled)
        want = {(g, k): b for g, t in step_traffic(job, rank).items()
                for k, (_, b) in t.calls.items()}
        assert got.keys() == want.keys()
        for key in want:
            assert got[key] == pytest.approx(want[key]), key


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("balance", ["headtail", "none"])
@pytest.mark.parametrize("name", ["tp_sp", "pp", "fsdp", "full", "3d", "zb_h1"])
def test_cp_schedules_are_deadlock_free(method, balance, name):
    check_schedule(build_schedule(cp_job(2, method, balance, **PLANS[name])).programs())


def test_cp4_with_tp_and_pp_is_deadlock_free():
    job = cp_job(4, "ring", "none", gpus=16, tp=2, pp=2, global_batch_size=4)
    check_schedule(build_schedule(job).programs())


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("balance", ["headtail", "none"])
def test_translated_programs_equal_built_ones(method, balance):
    """The template builder derives other ranks' programs by moving groups and peers; where
    CP ranks run different programs it keeps one template per CP rank, so every translated
    program equals the one built for that rank."""
    job = cp_job(2, method, balance, gpus=16, tp=2, pp=2, global_batch_size=4)  # dp=2
    sched = build_schedule(job)
    templates = set()
    for rank in range(job.grid.world_size):
        prog = sched.program(rank)
        assert prog.ops == build_program(job, rank).ops, rank
        templates.add(prog.template)
    per_cp = method == "ring" or (method == "allgather" and balance == "none")
    assert len(templates) == job.parallel.pp * (2 if per_cp else 1)


def test_cp_ranks_differ_without_balancing():
    job = cp_job(4, "ring", "none", gpus=4)
    kernels = [sum(op.kind == "attention" for op in build_program(job, r).ops) for r in range(4)]
    assert kernels[0] < kernels[1] < kernels[2] < kernels[3]


def test_ring_recv_is_posted_before_the_step_it_feeds_and_runs_beside_compute():
    """The next step's KV recv is issued before this step's kernel, on the p2p stream."""
    job = cp_job(4, "ring", gpus=4)
    ops = build_program(job, 1).ops
    layer = [(i, op) for i, op in enumerate(ops) if op.layer == 0 and op.phase == "fwd"]
    names = {op.name.rsplit("/", 1)[1]: i for i, op in layer}
    for j in range(1, 4):
        assert names[f"cp.kv.recv.s{j}"] < names[f"attn.s{j - 1}" if j > 1 else "attn"]
        assert names[f"cp.kv.recv.s{j}"] in ops[names[f"attn.s{j}"]].deps
    assert all(op.stream == "p2p" for _, op in layer if op.is_p2p)


@pytest.mark.parametrize("method", METHODS)
def test_activation_memory_divides_by_cp(method):
    """Activations of s/cp tokens (flash attention); model states sharded over dp x cp
    under FSDP; the KV buffers on top."""
    base = rank_memory(cp_job(1, gpus=4, zero_stage=3, global_batch_size=4), 0)
    job = cp_job(2, method, zero_stage=3, global_batch_size=4)
    mem = rank_memory(job, 0)
    assert mem.activations == pytest.approx(base.activations / 2)
    assert mem.params == pytest.approx(stage_params(job, 0) * 2 / 8)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", ["ddp", "tp_sp", "pp", "selective"])
def test_peak_of_memory_ops_agrees_with_the_static_model(method, name):
    job = cp_job(2, method, **PLANS[name])
    for stage in range(job.parallel.pp):
        rank = job.grid.rank(pp=stage)
        peak, _ = memory_peak(build_program(job, rank))
        assert peak == pytest.approx(rank_memory(job, rank).tensors, rel=0.01)


def test_cp1_programs_have_no_cp_ops():
    prog = build_program(cp_job(1, tp=2, global_batch_size=4), 0)
    assert not [op for op in prog.ops if op.group_name in ("cp", "dp-cp") or "cp." in op.name]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cp=st.sampled_from([2, 4]), tp=st.sampled_from([1, 2]), pp=st.sampled_from([1, 2]),
       method=st.sampled_from(METHODS), balance=st.sampled_from(["headtail", "none"]),
       zero=st.sampled_from([0, 1, 2, 3]), sp=st.booleans(),
       recompute=st.sampled_from(["none", "selective", "full"]))
def test_random_cp_plans_are_deadlock_free_and_move_the_closed_forms(cp, tp, pp, method, balance,
                                                                     zero, sp, recompute):
    job = cp_job(cp, method, balance, gpus=cp * tp * pp * 2, tp=tp, pp=pp, zero_stage=zero,
                 sp=sp and tp > 1, recompute=recompute, global_batch_size=2 * 2 * pp)
    sched = build_schedule(job)
    check_schedule(sched.programs())
    rank = job.grid.rank(cp=cp - 1, pp=pp - 1)
    got = defaultdict(float)
    for op in sched.program(rank).ops:
        if (op.is_collective or op.kind == "send") and not op.name.endswith("grad_norm.ar"):
            got[(op.group_name, op.kind)] += op.bytes
    want = {(g, k): b for g, t in step_traffic(job, rank).items() for k, (_, b) in t.calls.items()}
    assert got == pytest.approx(want)
