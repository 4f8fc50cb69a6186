"""Async TP: each SP all-gather -> GEMM and GEMM -> reduce-scatter pair as tp chunked steps.

Closed forms: per pair tp partial GEMMs of b*s/t rows (the pair's FLOPs, split evenly) and
tp - 1 sends of b*s*h/t bytes (the ring all-gather's or reduce-scatter's wire bytes);
a reduce-scatter ends with one sum of the rank's tp partial chunks (tp read, one written).
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter, defaultdict

import pytest

from tests.conftest import cluster, gpt
from twin.schedule.builder import build_schedule
from twin.schedule.check import check_schedule
from twin.sim.run import simulate
from twin.spec import ConfigError, ParallelPlan, build_job
from twin.workload.comm import step_traffic


def _job(tp=4, **plan):
    base = dict(tp=tp, sp=True, async_tp=True, compile=True, global_batch_size=4)
    base.update(plan)
    c = cluster()
    if base.get("float8", "none") != "none":  # an FP8 peak for its GEMMs
        c = dataclasses.replace(c, gpu=dataclasses.replace(
            c.gpu, peak_tflops={**c.gpu.peak_tflops, "fp8": 2 * c.gpu.peak_tflops["bf16"]}))
    return build_job(gpt(num_layers=2, activation="swiglu"), c, ParallelPlan(**base))


def _by(prog):
    out = defaultdict(float)
    for op in prog.ops:
        if op.group_name == "tp" and (op.is_collective or op.kind == "send"):
            out[op.kind] += op.bytes
    return dict(out)


@pytest.mark.parametrize("plan", [dict(), dict(recompute="full"), dict(tp=2, pp=2, global_batch_size=8),
                                  dict(recompute="full", recompute_early_stop=True),
                                  dict(float8="tensorwise", recompute="full"),
                                  dict(float8="tensorwise", recompute="full",
                                       recompute_early_stop=True)])
def test_async_tp_traffic_is_the_closed_form_and_the_wire_bytes_of_sp(plan):
    """(FP8 tensorwise: torchao's Float8 TP styles gather the forward's inputs in FP8, under
    async TP and plain SP alike, so the two still move the same wire bytes.)"""
    job, sync = _job(**plan), _job(**{**plan, "async_tp": False})
    for stage in range(job.parallel.pp):
        rank = job.grid.rank(pp=stage)
        for j in (job, sync):
            got = _by(build_schedule(j).program(rank))
            want = {k: b for k, (_, b) in step_traffic(j, rank)["tp"].calls.items()}
            assert got.keys() == want.keys() and all(got[k] == pytest.approx(want[k]) for k in want)
        a, s = step_traffic(job, rank)["tp"], step_traffic(sync, rank)["tp"]
        assert a.wire_bytes == pytest.approx(s.wire_bytes)


def test_each_pair_is_tp_partial_gemms_of_the_same_flops():
    job, sync = _job(), _job(async_tp=False)
    prog, ref = build_schedule(job).program(0), build_schedule(sync).program(0)
    flops = Counter()
    for op in prog.ops:
        if op.kind == "gemm":
            flops[op.name.split(".s")[0]] += op.flops
    assert flops == Counter({op.name: op.flops for op in ref.ops if op.kind == "gemm"})
    parts = [op for op in prog.ops if op.kind == "gemm" and op.name.rsplit("/", 1)[-1].startswith("qkv.s")]
    whole = next(op for op in ref.ops if op.name.endswith("/qkv"))
    assert len(parts) == 4 * job.model.num_layers * job.parallel.num_microbatches
    assert all(op.shape[0] == whole.shape[0] // 4 for op in parts)
    sums = [op for op in prog.ops if op.name.endswith(".reduce")]  # 4 RS pairs per layer
    assert len(sums) == 4 * job.model.num_layers * job.parallel.num_microbatches
    assert all(op.bytes == 2 * (4 + 1) * op.shape[0] for op in sums)  # tp chunks read, one written


def test_fp8_partial_gemms_cast_the_weight_once():
    """Under FP8 async TP's partial GEMMs cast their rows of the activation each and the
    weight once (the first step): the pair's casts move what the unchunked GEMM's cast does,
    not the weight tp times."""
    job, sync = _job(float8="tensorwise"), _job(float8="tensorwise", async_tp=False)
    casts = Counter()
    for op in build_schedule(job).program(0).ops:
        if op.name.endswith(".fp8_cast"):  # a partial GEMM's: name.sK.fp8_cast
            casts[re.sub(r"\.s\d+$", "", op.name.removesuffix(".fp8_cast"))] += op.bytes
    want = {op.name.removesuffix(".fp8_cast"): op.bytes
            for op in build_schedule(sync).program(0).ops if op.name.endswith(".fp8_cast")}
    assert casts == pytest.approx(want)


def test_async_tp_is_deadlock_free_and_overlaps():
    for plan in (dict(), dict(tp=2, pp=2, global_batch_size=8), dict(zero_stage=3, tp=2, dp=4)):
        assert check_schedule(build_schedule(_job(**plan)).programs())["ops"] > 0
    a, s = simulate(_job(), trace=None).summary, simulate(_job(async_tp=False), trace=None).summary
    # the partial GEMMs hide the copies: less TP communication left exposed than plain SP's
    # (the step itself may be slower on so small a model: more ops, more host time)
    assert a["exposed_comm_s"]["tp"] < 0.5 * s["exposed_comm_s"]["tp"]


@pytest.mark.parametrize("plan, words", [
    (dict(tp=1, sp=False), "async_tp=true overlaps tensor-parallel communication but parallel.tp=1"),
    (dict(sp=False), "set parallel.sp=true or async_tp=false"),
    (dict(compile=False), "set parallel.compile=true or async_tp=false"),
])
def test_async_tp_without_tp_or_sp_is_one_line(plan, words):
    with pytest.raises(ConfigError, match=words):
        _job(**plan)


def test_float8_tp_styles_gather_the_forward_inputs_in_fp8():
    """torchao's Float8ColwiseParallel / PrepareFloat8ModuleInput (torchtitan with float8 and
    TP): the shard of norm1's and norm2's outputs is cast to FP8 before SP's all-gather, which
    moves a byte per element; the GEMMs after it cast their weights only; the gradients'
    gathers in backward stay at e bytes."""
    job = _job(float8="tensorwise", async_tp=False, recompute="none")
    ops = build_schedule(job).program(0).ops
    byname = {op.name.rsplit("/", 2)[-2] + "/" + op.name.rsplit("/", 1)[1]: op for op in ops
              if op.layer == 0 and op.mb == 0}
    t, h, e, tp = job.parallel.micro_batch_size * job.model.seq_len, job.model.hidden_size, 2, 4
    for ag, gemm in (("ag1", "qkv"), ("ag2", "fc_gate")):
        gather, cast = byname[f"L0/{ag}"], byname[f"L0/{ag}.fp8_cast"]
        assert gather.kind == "all_gather" and gather.bytes == t * h and gather.dtype == "fp8"
        assert cast.shape[0] == t * h // tp and ops[gather.deps[0]] is cast
        m, n, k = byname[f"L0/{gemm}"].shape
        assert byname[f"L0/{gemm}.fp8_cast"].shape[0] == k * n  # the weight alone
    backward = [op for op in ops if op.kind == "all_gather" and op.phase == "bwd"]
    assert backward and all(op.bytes == t * h * e and op.dtype != "fp8" for op in backward)
    for recompute in ("op", "full", "none"):  # the closed form moves the same bytes
        j = _job(float8="tensorwise", async_tp=False, recompute=recompute)
        got = _by(build_schedule(j).program(0))
        want = {k: b for k, (_, b) in step_traffic(j, 0)["tp"].calls.items()}
        assert got == pytest.approx(want)
