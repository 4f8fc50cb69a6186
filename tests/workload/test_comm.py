"""Closed-form traffic per step: DDP = gradients, ZeRO-3 = 1.5x DDP, TP and SP, PP messages."""

from __future__ import annotations

import pytest

from tests.conftest import cluster, gpt
from twin.spec import ParallelPlan, build_job
from twin.workload.comm import step_traffic
from twin.workload.params import layer_params, stage_params


def _traffic(**plan):
    j = build_job(gpt(), cluster(), ParallelPlan(**plan))
    return j, step_traffic(j, 0)


def test_ddp_all_reduces_the_gradients_once():
    j, t = _traffic(global_batch_size=32)  # 4 micro-batches, no_sync until the last
    grads = stage_params(j, 0) * 2
    assert t["dp"].calls == {"all_reduce": [1, grads]}
    assert t["dp"].wire_bytes == pytest.approx(2 * 7 / 8 * grads)


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_1_2_move_what_ddp_moves(zero):
    _, ddp = _traffic()
    _, z = _traffic(zero_stage=zero)
    assert z["dp"].wire_bytes == pytest.approx(ddp["dp"].wire_bytes)


def test_zero_3_moves_one_and_a_half_ddp():
    # ZeRO §7: gather for forward, again for backward, reduce-scatter: 3 Psi vs DDP's 2 Psi,
    # per layer unit; FSDP's root unit (embedding, head) is gathered once: 2 Psi_root.
    # (gradients reduced at the model's bf16, as ZeRO counts; fp32, the default, moves the
    # reduce-scatter's bytes twice)
    j, ddp = _traffic()
    _, z3 = _traffic(zero_stage=3, fsdp_reduce_dtype="bf16")
    layers = 8 * layer_params(j.model).total
    root = stage_params(j, 0) - layers
    n = 8
    unit_wire = (n - 1) / n * 2  # bytes per element, bf16
    assert z3["dp"].wire_bytes == pytest.approx(unit_wire * (3 * layers + 2 * root))
    assert ddp["dp"].wire_bytes == pytest.approx(unit_wire * 2 * (layers + root))
    _, keep = _traffic(zero_stage=3, fsdp_reshard_after_forward=False, fsdp_reduce_dtype="bf16")
    assert keep["dp"].wire_bytes == pytest.approx(ddp["dp"].wire_bytes)
    _, fp32 = _traffic(zero_stage=3)
    assert fp32["dp"].wire_bytes == pytest.approx(z3["dp"].wire_bytes + unit_wire * (layers + root))


def test_tp_four_all_reduces_per_layer_and_sp_moves_the_same():
    j, tp = _traffic(tp=8, global_batch_size=2)
    m, bsh = j.parallel.num_microbatches, 1 * 128 * 256 * 2
    layers = 8
    # 4 per layer + embedding forward + LM head backward + 3 small cross-entropy reductions
    assert tp["tp"].calls["all_reduce"][0] == 4 * layers * m + 2 * m + 3 * m
    _, sp = _traffic(tp=8, sp=True, global_batch_size=2)
    big = {k: v for k, v in sp["tp"].calls.items() if k != "all_reduce"}
    assert big == {"all_gather": [(4 * layers + 2) * m, (4 * layers + 2) * m * bsh],
                   "reduce_scatter": [(4 * layers + 2) * m, (4 * layers + 2) * m * bsh]}
    assert sp["tp"].wire_bytes == pytest.approx(tp["tp"].wire_bytes)


def test_pp_sends_bsh_per_microbatch_and_boundary_times_v():
    plain = build_job(gpt(), cluster(gpus=4), ParallelPlan(pp=4, global_batch_size=8))
    inter = build_job(gpt(), cluster(gpus=4), ParallelPlan(
        pp=4, pp_schedule="interleaved", pp_virtual_stages=2, global_batch_size=8))
    bsh = 128 * 256 * 2
    for j, v in ((plain, 1), (inter, 2)):
        total = sum(step_traffic(j, r)["pp"].bytes for r in range(4))
        boundaries = 4 * v - 1
        assert total == 2 * boundaries * 8 * bsh  # forward and backward per micro-batch
    sp = build_job(gpt(), cluster(gpus=8), ParallelPlan(pp=4, tp=2, sp=True, global_batch_size=8))
    assert step_traffic(sp, 0)["pp"].bytes == 8 * bsh / 2  # b*s*h/t under SP
