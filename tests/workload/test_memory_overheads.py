"""What the static tensors leave out: each new memory category against its closed form."""

from __future__ import annotations

import dataclasses

import pytest

from tests.conftest import cluster, gpt
from twin.spec import GPUSpec, IntraNodeSpec, ParallelPlan, build_job
from twin.trace import Span, Trace
from twin.workload import memory as mm
from twin.workload.memory import (
    Memory,
    activation_bytes_per_layer,
    allocator_reserve_bytes,
    comm_buffer_bytes,
    layer_temporary_bytes,
    loss_temporary_bytes,
    rank_memory,
    temporary_bytes,
    workspace_bytes,
)
from twin.workload.params import layer_params
from twin.workload.summary import format_inspect, inspect_job

MIB = 2 ** 20
CONN = 4 * MIB + 120 * 640 * 8 * 8 + 8 * 512 * 8 * 16  # Simple + LL128 + LL, NCCL init.cc


def _gpu(name: str = "H100-SXM5-80GB", gpus: int = 8):
    return dataclasses.replace(cluster(gpus=gpus), gpu=GPUSpec(name=name,
                                                               peak_tflops={"bf16": 989.0}))


def _cpu():
    return cluster(intra=IntraNodeSpec(kind="shared_cpu"))


def test_nccl_buffer_sizes_are_nccls_defaults():
    assert mm.NCCL_SIMPLE_BUFF_BYTES == 4_194_304
    assert mm.NCCL_LL128_BUFF_BYTES == 4_915_200
    assert mm.NCCL_LL_BUFF_BYTES == 524_288
    assert mm.NCCL_CONNECTION_BYTES == CONN


def test_comm_buffers_one_set_per_channel_per_communicator():
    dp = build_job(gpt(), _gpu(), ParallelPlan(zero_stage=3))
    assert comm_buffer_bytes(dp, 0) == 16 * CONN
    two = build_job(gpt(), _gpu(), ParallelPlan(tp=2, global_batch_size=4))
    assert comm_buffer_bytes(two, 0) == 2 * 16 * CONN  # the dp and the tp communicators


def test_pipeline_p2p_buffers_per_neighbour():
    job = build_job(gpt(), _gpu(gpus=4), ParallelPlan(pp=4, global_batch_size=8))
    first, middle = (comm_buffer_bytes(job, job.grid.rank(pp=s)) for s in (0, 1))
    assert first == 1 * 2 * CONN and middle == 2 * 2 * CONN


def test_workspace_by_architecture():
    assert workspace_bytes(_gpu("H100-SXM5-80GB")) == 2 * 32 * MIB
    assert workspace_bytes(_gpu("A100-SXM4-80GB")) == 2 * 4 * MIB


def test_loss_temporary_closed_forms():
    m = gpt(vocab_size=1000, seq_len=128)
    n = 128 * 2 * 1000
    assert loss_temporary_bytes(m, 2, tp=1) == 8 * n  # nll grad + log-softmax grad
    assert loss_temporary_bytes(m, 2, tp=4) == 12 * n // 4  # loss_parallel's x-max, exp, sum
    assert loss_temporary_bytes(dataclasses.replace(m, dtype="fp32"), 2) == 8 * n


def test_a_compiled_loss_saves_the_logits_and_their_logsumexp_and_makes_one_gradient():
    """torch.compile of the loss (torchtitan's compile.components 'loss', default since 2025):
    it saves the e-byte logits and an fp32 log-sum-exp per token, not the fp32 log-softmax
    (4N), and its backward makes the logits' e-byte gradient, not the fp32 ones (8N); under
    loss_parallel (tp > 1) the vocabulary-parallel eager forms stay."""
    m = gpt(vocab_size=1000, seq_len=128)
    n, e = 128 * 2 * 1000, m.dtype_bytes
    assert loss_temporary_bytes(m, 2, tp=1, compiled=True) == e * n
    assert loss_temporary_bytes(m, 2, tp=4, compiled=True) == loss_temporary_bytes(m, 2, tp=4)

    def last_stage(**plan):
        job = build_job(gpt(vocab_size=50000), _gpu(gpus=2),
                        ParallelPlan(pp=2, global_batch_size=4, **plan))
        return job, job.grid.rank(pp=1)

    (eager, r), (compiled, _) = last_stage(compile=True, compile_loss=False), \
        last_stage(compile=True)
    s, b, v = compiled.model.seq_len, 1, compiled.model.vocab_size
    got, want = rank_memory(compiled, r), rank_memory(eager, r)
    assert want.activations - got.activations == pytest.approx((4 - e) * s * b * v - 4 * s * b)
    layer = layer_temporary_bytes(compiled.model, b, flash_attention=True)
    assert got.temporary == max(layer, e * s * b * v)
    # without torch.compile the loss is eager whatever compile_loss says
    plain, _ = last_stage()
    assert rank_memory(plain, r).activations == want.activations
    assert rank_memory(plain, r).temporary == want.temporary


def test_layer_temporary_eager_attention_and_recompute():
    m = gpt()
    s, a, e = m.seq_len, m.num_heads, m.dtype_bytes
    assert layer_temporary_bytes(m, 1, recompute="none", flash_attention=False) == 2 * e * a * s * s
    full = layer_temporary_bytes(m, 1, recompute="full", flash_attention=True)
    none = activation_bytes_per_layer(m, 1, recompute="none", flash_attention=True)
    kept = activation_bytes_per_layer(m, 1, recompute="full", flash_attention=True)
    assert full == none - kept + 4 * s * a * m.head_dim  # the layer again + FA2's fp32 dQ


def test_op_level_sac_keeps_input_odd_matmuls_and_attention():
    # torchtitan's policy on a Llama layer: x, wq, wv, w1 (gate), w2 outputs, SDPA out + LSE.
    m = gpt(hidden_size=4096, num_heads=32, num_kv_heads=8, ffn_hidden_size=14336,
            activation="swiglu", seq_len=8192)
    sb, h, kv, f = 8192, 4096, 1024, 14336
    expected = 2 * sb * (h + h + kv + f + h) + 2 * sb * h + 4 * sb * 32
    assert activation_bytes_per_layer(m, 1, recompute="op", flash_attention=True) == expected


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp_sp"])
def test_op_level_sac_under_tp_keeps_the_local_shards_and_the_reduce_scatters(sp):
    # the same policy on one of 4 TP ranks: wq, wv and w1 outputs are column shards (/t),
    # w2's output is the row-parallel partial sum (whole), the attention's output and LSE
    # are the rank's heads; under SP the block input is a sequence shard and the two
    # reduce-scatter outputs (in _save_list) are kept too
    m = gpt(hidden_size=4096, num_heads=32, num_kv_heads=8, ffn_hidden_size=14336,
            activation="swiglu", seq_len=8192)
    sb, h, kv, f, t = 8192, 4096, 1024, 14336, 4
    x = h / t if sp else h
    expected = 2 * sb * (x + h / t + kv / t + f / t + h) + 2 * sb * h / t + 4 * sb * 32 / t
    if sp:
        expected += 2 * 2 * sb * h / t
    got = activation_bytes_per_layer(m, 1, tp=t, sp=sp, recompute="op", flash_attention=True)
    assert got == pytest.approx(expected)


def test_temporary_is_the_larger_of_loss_and_layer_on_the_last_stage_only():
    job = build_job(gpt(), _gpu(gpus=2), ParallelPlan(pp=2, global_batch_size=4))
    b, last = 1, job.grid.rank(pp=1)
    layer = layer_temporary_bytes(job.model, b, flash_attention=True)
    assert temporary_bytes(job, 0) == layer
    assert temporary_bytes(job, last) == max(layer, loss_temporary_bytes(job.model, b))


def test_allocator_reserve_fraction_and_rounding_floor():
    f = mm.FRAGMENTATION
    assert allocator_reserve_bytes(85e9) == pytest.approx(f / (1 - f) * 85e9)
    assert allocator_reserve_bytes(1e6, live_tensors=100) == 100 * MIB


def test_total_is_the_sum_and_the_views_nest():
    mem = rank_memory(build_job(gpt(), _gpu(), ParallelPlan(zero_stage=3)), 0)
    d = mem.as_dict()
    assert d["total"] == pytest.approx(sum(v for k, v in d.items() if k != "total"))
    assert mem.tensors < mem.allocated < mem.reserved < mem.total
    assert mem.reserved == pytest.approx(mem.allocated + mem.allocator_reserve)
    assert mem.total == pytest.approx(mem.reserved + mem.comm_buffers + mem.cuda_context)
    assert mem.cuda_context == mm.CUDA_CONTEXT_BYTES


def test_cpu_ranks_have_no_cuda_overheads():
    mem = rank_memory(build_job(gpt(), _cpu(), ParallelPlan()), 0)
    assert mem.workspace == mem.comm_buffers == mem.cuda_context == mem.allocator_reserve == 0
    assert mem.temporary > 0 and mem.total == pytest.approx(mem.tensors + mem.temporary)


@pytest.mark.parametrize("reduce_dtype,r", [("fp32", 4), ("bf16", 2)])
def test_fsdp_accumulating_grads_hold_every_unit_at_the_reduce_dtype(reduce_dtype, r):
    m = gpt()
    plan = dict(zero_stage=3, global_batch_size=32, fsdp_reduce_dtype=reduce_dtype)
    every = rank_memory(build_job(m, _gpu(), ParallelPlan(**plan)), 0)
    last = rank_memory(build_job(m, _gpu(), ParallelPlan(grad_sync="last", **plan)), 0)
    job = build_job(m, _gpu(), ParallelPlan(**plan))
    unit = layer_params(m, 1).total
    root = mm.stage_params(job, 0) - m.num_layers * unit
    assert last.buffers - every.buffers == pytest.approx(
        (root + m.num_layers * unit) * r - (root + unit) * 2)


def test_inspect_reports_and_checks_the_new_total():
    job = build_job(gpt(), _gpu(), ParallelPlan(zero_stage=3))
    rep = inspect_job(job)
    mem = rep["ranks"][0]["memory_bytes"]
    assert {"temporary", "workspace", "allocator_reserve", "comm_buffers",
            "cuda_context"} <= set(mem)
    assert rep["ranks"][0]["headroom_bytes"] == pytest.approx(job.cluster.hbm_bytes - mem["total"])
    tight = dataclasses.replace(job.cluster, gpu=dataclasses.replace(
        job.cluster.gpu, hbm_GB=(mem["total"] - 0.5 * mem["cuda_context"]) / 1e9))
    assert inspect_job(dataclasses.replace(job, cluster=tight))["fits_memory"] is False
    assert "reserve" in format_inspect(rep) and "runtime" in format_inspect(rep)


def _trace(peak: float) -> Trace:
    spans = [Span(rank=0, step=0, op="a", kind="alloc", stream="compute", start_us=0.0,
                  end_us=0.0, bytes=peak, category="activations"),
             Span(rank=0, step=0, op="f", kind="free", stream="compute", start_us=10.0,
                  end_us=10.0, bytes=peak, category="activations")]
    return Trace(spans=spans)


def test_report_figure_draws_the_static_categories_and_their_oom():
    from twin.report.memory import memory_figure
    static = Memory(activations=1e9, temporary=2e8, allocator_reserve=3e8, workspace=1e8,
                    comm_buffers=1e8, cuda_context=4e8).as_dict()
    fig, note = memory_figure(_trace(1e9), hbm_bytes=1.8e9, static={0: static})
    names = {t.name for t in fig.data}
    assert {"cuda_context", "comm_buffers", "workspace", "activations"} <= names
    assert any(n.startswith("at the peak") for n in names)
    assert "OUT OF MEMORY" in note  # 1.0 + 0.6 under + 0.5 at the peak > 1.8 GB
    fig, note = memory_figure(_trace(1e9), hbm_bytes=1.8e9)
    assert "OUT OF MEMORY" not in note
