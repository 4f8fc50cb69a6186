"""FSDP2's copies in the schedule (twin.schedule.sharded): a gathered unit's copy-out and a
unit's gradients' copy-in, on the compute stream; timed as one kernel each, without the
eager factor a profile folds into its elementwise ops (CostModel.kernel_of)."""

from __future__ import annotations

import dataclasses

import pytest

from paratwin.config import preset_cluster
from tests.conftest import gpt
from twin.cost import KernelCost, default_cost_model
from twin.schedule.step import build_program
from twin.spec import ParallelPlan, build_job

H100 = preset_cluster("dgx_h100")
MODEL = gpt(num_layers=4, hidden_size=512, num_heads=8, num_kv_heads=8, ffn_hidden_size=2048,
            seq_len=512, vocab_size=8000)


def _ops(**plan):
    job = build_job(MODEL, H100, ParallelPlan(zero_stage=3, global_batch_size=16,
                                              micro_batch_size=2, **plan))
    return job, build_program(job, 0).ops


def _local(op) -> str:
    return op.name.rsplit("/", 1)[-1]


@pytest.mark.parametrize("plan", [{}, {"fsdp_reshard_after_forward": False}, {"pp": 2},
                                  {"grad_sync": "last"}, {"tp": 2, "sp": True}],
                         ids=["reshard", "keep", "pp2", "sync_last", "tp2"])
def test_one_copy_out_per_gather_and_one_copy_in_per_reduce_scatter(plan):
    job, ops = _ops(**plan)
    e, r = job.model.dtype_bytes, job.fsdp_reduce_bytes  # the copy-in casts e -> r bytes
    gathers = [i for i, op in enumerate(ops) if _local(op) in ("param.ag", "root.param.ag")]
    outs = [i for i, op in enumerate(ops) if _local(op).endswith("param.copy_out")]
    scatters = [i for i, op in enumerate(ops) if _local(op) in ("grad.rs", "root.grad.rs")]
    ins = [i for i, op in enumerate(ops) if _local(op).endswith("grad.copy_in")]
    assert gathers and scatters
    assert len(outs) == len(gathers) and len(ins) == len(scatters)
    # each copy-out waits for its own gather and copies its bytes: read once, written once
    assert sorted(ops[i].deps[0] for i in outs) == gathers
    for i in outs:
        ag = ops[ops[i].deps[0]]
        assert ops[i].deps == (ops.index(ag),)
        assert ops[i].layer == ag.layer and ops[i].stream == "compute"
        assert ops[i].bytes == pytest.approx(2 * ag.bytes) and ops[i].flops == 0
        assert ops[i].shape[1:] == (1,) and ops[i].one_kernel  # one kernel (no eager factor)
    # each reduce-scatter waits for its copy-in only, which holds the unit's gradients
    for i in scatters:
        (j,) = ops[i].deps
        assert j in ins and ops[j].stream == "compute" and ops[j].layer == ops[i].layer
        assert ops[j].bytes == pytest.approx(ops[i].bytes * (e + r) / r)
        assert all(ops[d].is_compute for d in ops[j].deps) and ops[j].deps
        assert ops[i].dtype == job.parallel.fsdp_reduce_dtype


@pytest.mark.parametrize("hsdp", [False, True])
def test_gradients_are_reduced_at_the_reduce_dtype(hsdp):
    """fp32 (torchtitan's default) moves twice a bf16 model's gradient bytes in every
    reduce-scatter (and HSDP all-reduce) and casts them up in the copy-in (2 + 4 bytes per
    element, not 2 + 2); the gathers do not change."""
    extra = {"dp_replicate": 2} if hsdp else {}
    j32, fp32 = _ops(**extra)
    j16, bf16 = _ops(fsdp_reduce_dtype="bf16", **extra)
    assert j32.model.dtype == "bf16" and j32.parallel.fsdp_reduce_dtype == "fp32"
    assert [op.name for op in fp32] == [op.name for op in bf16]
    kinds = {"reduce_scatter": 2.0, "all_gather": 1.0, "all_reduce": 2.0}
    for a, b in zip(fp32, bf16):
        if a.kind in kinds and "grad_norm" not in a.name:
            assert a.bytes == pytest.approx(kinds[a.kind] * b.bytes), a.name
        elif a.name.endswith("grad.copy_in"):
            assert a.bytes == pytest.approx(1.5 * b.bytes)
        else:
            assert a.bytes == b.bytes, a.name
    assert any(a.kind == "all_reduce" and a.group_name == "dp_replicate" for a in fp32) == hsdp


def test_a_layer_computes_after_its_copy_out():
    """The unit's first op of each forward waits (through its input chain) for the copy-out:
    the copy-out is the compute op right before the layer's first norm."""
    _, ops = _ops()
    for i, op in enumerate(ops):
        if _local(op) == "param.copy_out" and op.phase == "fwd":
            nxt = next(o for o in ops[i + 1:] if o.is_compute)
            assert nxt.layer == op.layer and nxt.mb == op.mb and i in nxt.deps


def test_no_copies_without_fsdp():
    job = build_job(MODEL, H100, ParallelPlan(zero_stage=1, global_batch_size=16))
    assert not [op for op in build_program(job, 0).ops if "copy" in op.name]


def test_a_copy_is_one_kernel_under_the_eager_factor():
    """A profile that folds an eager factor f into its elementwise kind times the layers' ops
    at mem_efficiency, FSDP2's copies (one kernel) at f times it (at most 1), their host time
    over f: t = launch + bytes / (HBM * min(1, eff * f))."""
    _, ops = _ops()
    copy = next(op for op in ops if _local(op) == "param.copy_out")
    plain = dataclasses.replace(copy, shape=copy.shape[:1])
    assert copy.one_kernel and not plain.one_kernel
    f, eff = 4.0, 0.2
    cost = dataclasses.replace(default_cost_model(H100), eager_elementwise=f,
                               elementwise=KernelCost(efficiency=0.5, mem_efficiency=eff,
                                                      launch_us=3.0, host_us=40.0))
    hbm = H100.gpu.hbm_bw_GBps * 1e9
    assert cost.compute_time(copy, H100.gpu) == pytest.approx(3e-6 + copy.bytes / (hbm * eff * f))
    assert cost.compute_time(plain, H100.gpu) == pytest.approx(3e-6 + copy.bytes / (hbm * eff))
    assert cost.host_time(copy) == pytest.approx(10e-6)
    assert cost.host_time(plain) == pytest.approx(40e-6)
    # compiled (parallel.compile): the factor is out of both
    fused = cost.compiled()
    assert fused.compute_time(plain, H100.gpu) == pytest.approx(cost.compute_time(copy, H100.gpu))
    assert fused.compute_time(copy, H100.gpu) == pytest.approx(cost.compute_time(copy, H100.gpu))
    # nothing folded in: a copy is an elementwise op like any other
    one = dataclasses.replace(cost, eager_elementwise=1.0)
    assert one.compute_time(copy, H100.gpu) == one.compute_time(plain, H100.gpu)
