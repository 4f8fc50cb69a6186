"""Interleaved 1F1B exchanges as Megatron does: after each step (a warm-up forward, a
steady-state forward-backward pair, a cool-down backward) one batch sends the step's outputs
and receives the next step's inputs, so a host that waits for every batch (Megatron's
synchronize after batch_isend_irecv: p2p_host_sync) never deadlocks."""

from __future__ import annotations

import dataclasses

import pytest

from tests.conftest import cluster, gpt
from twin.cost import CostModel, KernelCost
from twin.schedule.builder import build_schedule
from twin.sim.run import simulate
from twin.spec import ParallelPlan, build_job

SYNC = CostModel(name="host-sync", p2p_host_sync=True, p2p_latency_us=20.0,
                 gemm=KernelCost(efficiency=0.5, host_us=10.0),
                 elementwise=KernelCost(mem_efficiency=0.5, host_us=10.0))


def _job(p, v, m):
    model = gpt(num_layers=p * v * 2, hidden_size=128, num_heads=4, num_kv_heads=4,
                ffn_hidden_size=512, seq_len=64)
    return build_job(model, cluster(gpus=p), ParallelPlan(
        pp=p, dp=1, pp_schedule="interleaved", pp_virtual_stages=v, micro_batch_size=1,
        global_batch_size=m))


def _batches(program):
    """The program's send/recv batches: runs of consecutive p2p ops (memory ops aside)."""
    out, cur = [], []
    for op in program.ops:
        if op.stream == "mem":
            continue
        if op.is_p2p:
            cur.append(op)
        elif cur:
            out.append(cur)
            cur = []
    return out + ([cur] if cur else [])


@pytest.mark.parametrize("p, v, m", [(2, 2, 2), (2, 2, 4), (4, 2, 4), (4, 2, 8), (2, 3, 6),
                                     (4, 3, 12)])
def test_a_host_that_waits_for_every_batch_does_not_deadlock(p, v, m):
    job = _job(p, v, m)
    synced = simulate(job, SYNC).summary.step_time_s
    free = simulate(job, dataclasses.replace(SYNC, p2p_host_sync=False)).summary.step_time_s
    assert synced >= free > 0


@pytest.mark.parametrize("p, v, m", [(2, 2, 4), (4, 2, 4), (4, 2, 8)])
def test_one_batch_per_step_with_the_steps_outputs_and_the_next_steps_inputs(p, v, m):
    sched = build_schedule(_job(p, v, m))
    for stage in range(p):
        warmup = min((p - stage - 1) * 2 + (v - 1) * p, m * v)  # Megatron's warm-up forwards
        pairs = m * v - warmup  # steady-state (forward, backward) pairs; the rest cool down
        batches = _batches(sched.program(stage))
        # at most one batch per step (a step with no output to send and no input to receive
        # next has none), and a receive-only batch before the first step on later stages
        assert len(batches) <= warmup + pairs + (m * v - pairs) + (stage > 0)
        sizes = [len(b) for b in batches]
        assert sum(sizes) == sum(op.is_p2p for op in sched.program(stage).ops)
        assert max(sizes) <= 4 and sizes.count(4) <= pairs  # two sends, two recvs: a pair's
        for batch in batches:  # the step's sends, then the next step's receives
            kinds = [op.kind for op in batch]
            assert kinds == sorted(kinds, key=lambda k: k != "send")
