"""The memory-bound ops a step has besides its GEMMs and attention, by their closed forms:
RoPE on the queries and keys, the gradient clip's norm and scale, and Adam's bytes fused and
as PyTorch's foreach implementation runs it."""

from __future__ import annotations

import dataclasses

import pytest

from tests.conftest import cluster, gpt
from twin.schedule.builder import build_schedule
from twin.spec import ConfigError, ParallelPlan, build_job
from twin.workload.params import stage_params

LLAMA = gpt(num_layers=2, hidden_size=256, num_heads=8, num_kv_heads=2, ffn_hidden_size=512,
            activation="swiglu", seq_len=128)


def program(model, **plan):
    job = build_job(model, cluster(gpus=4), ParallelPlan(**plan))
    return job, build_schedule(job).program(0)


def ops_named(prog, suffix):
    return [op for op in prog.ops if op.name.endswith(suffix)]


@pytest.mark.parametrize("tp", [1, 2])
def test_rope_reads_and_writes_the_local_queries_and_keys_once_each_way(tp):
    job, prog = program(LLAMA, tp=tp, dp=4 // tp, micro_batch_size=2)
    tokens, d = 2 * 128, LLAMA.head_dim
    q, kv = 8 // tp * d, max(1, 2 // tp) * d
    fwd, bwd = ops_named(prog, "/rope"), ops_named(prog, "/rope.bwd")
    assert len(fwd) == len(bwd) == LLAMA.num_layers  # one per layer per micro-batch (one here)
    for op in fwd + bwd:
        assert op.kind == "elementwise"
        assert op.bytes == 2 * 2 * tokens * (q + kv)  # bf16, read and written
    # a GPT with learned positions rotates nothing
    _, gpt_prog = program(gpt(num_layers=2), dp=4)
    assert not ops_named(gpt_prog, "/rope") and not ops_named(gpt_prog, "/rope.bwd")


@pytest.mark.parametrize("zero_stage", [0, 1, 3])
def test_the_clip_reads_the_local_gradients_then_scales_them(zero_stage):
    job, prog = program(LLAMA, dp=4, zero_stage=zero_stage)
    params = stage_params(job, 0)
    local = -(-params // 4) if zero_stage else params
    (norm,) = ops_named(prog, "/grad_norm")
    (clip,) = ops_named(prog, "/clip")
    ar = ops_named(prog, "/grad_norm.ar")
    (adam,) = [op for op in prog.ops if op.kind == "optimizer"]
    assert norm.bytes == 2 * local and clip.bytes == 2 * 2 * local
    # in order: squares, their all-reduce (over the ranks holding other shards: dp under
    # ZeRO; none left at tp = pp = 1 without it), the scale, then the step
    idx = {id(op): i for i, op in enumerate(prog.ops)}
    assert len(ar) == (1 if zero_stage else 0)
    before_clip = ar[0] if ar else norm
    assert idx[id(norm)] <= idx[id(before_clip)] < idx[id(clip)] < idx[id(adam)]
    assert idx[id(before_clip)] in clip.deps and idx[id(clip)] in adam.deps
    if ar:
        assert idx[id(norm)] in ar[0].deps


def test_adam_bytes_fused_and_foreach():
    for kernels, per_param in (("fused", 24 + 2 * 2), ("foreach", 64 + 2 * 2)):
        job, prog = program(LLAMA, dp=4, optimizer_kernels=kernels)
        (adam,) = [op for op in prog.ops if op.kind == "optimizer"]
        params = stage_params(job, 0)
        assert adam.shape == (params, int(kernels == "fused"))
        assert adam.bytes == params * per_param
    fp32 = dataclasses.replace(LLAMA, dtype="fp32")
    _, prog = program(fp32, dp=4, optimizer_kernels="foreach")
    (adam,) = [op for op in prog.ops if op.kind == "optimizer"]
    assert adam.bytes / adam.shape[0] == 72  # PyTorch's AdamW on fp32: 18 passes of 4 bytes


def test_an_unknown_optimizer_implementation_is_refused():
    with pytest.raises(ConfigError, match="parallel.optimizer_kernels"):
        ParallelPlan(optimizer_kernels="apex")
