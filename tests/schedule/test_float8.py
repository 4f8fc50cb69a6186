"""FP8 training (torchao Float8Linear as torchtitan converts it) and the optimizer's state dtype.

Closed forms: a transformer layer's linear GEMMs run at the GPU's FP8 peak with 1-byte
operands, each after a cast of its two operands (an amax read and a cast: 2e + 1 bytes per
element); the LM head and attention stay in the model dtype; MFU is taken against the FP8
peak; Adam's momentum and variance in bf16 hold 4 + 2 + 2 bytes per parameter, not 12.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.conftest import cluster, gpt
from twin.cost import CostModel
from twin.metrics import throughput
from twin.schedule.builder import build_schedule
from twin.schedule.check import check_schedule
from twin.spec import ConfigError, GPUSpec, ParallelPlan, build_job
from twin.workload.memory import rank_memory

H100 = GPUSpec(name="H100", peak_tflops={"bf16": 989.0, "fp8": 1979.0, "fp32": 67.0})
LINEARS = {"qkv", "out_proj", "fc1", "fc2"}


def _job(float8="tensorwise", gpu=H100, **plan):
    base = dict(float8=float8, global_batch_size=8)
    base.update(plan)
    return build_job(gpt(), dataclasses.replace(cluster(), gpu=gpu), ParallelPlan(**base))


def _base(name: str) -> str:
    return name.split("/")[-1].split(".")[0]


def test_linear_gemms_run_in_fp8_after_casting_their_operands():
    prog = build_schedule(_job()).program(0)
    bf16 = build_schedule(_job("none")).program(0)
    gemms = [op for op in prog.ops if op.kind == "gemm"]
    assert len(gemms) == sum(op.kind == "gemm" for op in bf16.ops)
    ops = {op.name: op for op in prog.ops}
    fp8 = [op for op in gemms if _base(op.name) in LINEARS]
    assert fp8 and all(op.dtype == "fp8" for op in fp8)
    assert all(op.dtype == "bf16" for op in gemms if _base(op.name) not in LINEARS)  # lm_head
    assert all(op.dtype == "bf16" for op in prog.ops if op.kind == "attention")
    for op in fp8:
        m, n, k = op.shape
        assert op.bytes == m * k + k * n + 2 * m * n  # fp8 operands, bf16 output
        assert op.flops == 2 * m * n * k
        cast = ops[op.name + ".fp8_cast"]
        assert cast.kind == "elementwise" and cast.bytes == (2 * 2 + 1) * (m * k + k * n)
        assert any(prog.ops[d].name == cast.name for d in op.deps)
    assert check_schedule(build_schedule(_job(tp=2, sp=True)).programs())["ops"] > 0


def test_compiled_casts_fuse_an_activations_amax_into_its_producer():
    """Under parallel.compile an activation's or gradient's cast reads e and writes 1 byte
    per element (its amax computed by the compiled kernel that made it); a weight (the k x n
    operand of the forward and dgrad GEMMs) still pays the amax read: 2e + 1. A wgrad's two
    operands are both activations. Eager: 2e + 1 for every operand."""
    ops = {op.name: op for op in build_schedule(_job(compile=True)).program(0).ops}
    eager = {op.name: op for op in build_schedule(_job()).program(0).ops}
    seen = set()
    for name, op in ops.items():
        if op.kind != "gemm" or op.dtype != "fp8":
            continue
        m, n, k = op.shape
        cast = ops[name + ".fp8_cast"]
        if name.endswith(".wgrad"):
            assert cast.bytes == (2 + 1) * (m * k + k * n)
        else:
            assert cast.bytes == (2 + 1) * m * k + (2 * 2 + 1) * k * n
        assert eager[cast.name].bytes == (2 * 2 + 1) * (m * k + k * n)
        assert cast.shape == eager[cast.name].shape  # the same elements, fewer bytes
        seen.add(name.rsplit(".", 1)[1] if "grad" in name.rsplit("/", 1)[1] else "fwd")
    assert seen == {"fwd", "dgrad", "wgrad"}


def test_fp8_gemm_time_at_the_fp8_peak():
    prog = build_schedule(_job()).program(0)
    ref = build_schedule(_job("none")).program(0)
    cost = dataclasses.replace(CostModel(), gemm=dataclasses.replace(CostModel().gemm, tile=0,
                                                                     half_flops=0.0,
                                                                     launch_us=0.0))
    fc1 = next(op for op in prog.ops if op.name.endswith("fc1") and op.phase == "fwd")
    fc1_ref = next(op for op in ref.ops if op.name == fc1.name)
    eff = cost.gemm.efficiency
    assert cost.compute_time(fc1, H100) == pytest.approx(
        max(fc1.flops / (1979e12 * eff), fc1.bytes / (H100.hbm_bw_GBps * 1e9 * cost.gemm.mem_efficiency)))
    assert cost.compute_time(fc1_ref, H100) >= cost.compute_time(fc1, H100)


def test_mfu_is_against_the_fp8_peak():
    job, ref = _job(), _job("none")
    _, tflops, mfu = throughput(job, 1.0)
    _, _, mfu_ref = throughput(ref, 1.0)
    assert job.peak_dtype == "fp8" and ref.peak_dtype == "bf16"
    assert mfu == pytest.approx(tflops / 1979.0) and mfu_ref == pytest.approx(tflops / 989.0)


@pytest.mark.parametrize("float8, gpu, words", [
    ("tensorwise", GPUSpec(name="A100", peak_tflops={"bf16": 312.0}), "A100 has no fp8 peak"),
    ("mxfp8", H100, "H100 has no mxfp8 peak"),
    ("e4m3", H100, "parallel.float8='e4m3' is not one of"),
])
def test_float8_without_the_hardware_says_so(float8, gpu, words):
    with pytest.raises(ConfigError, match=words):
        _job(float8, gpu)


def test_bf16_optimizer_states_hold_eight_bytes_per_parameter():
    fp32 = rank_memory(_job("none"), 0)
    bf16 = rank_memory(_job("none", optimizer_dtype="bf16"), 0)
    assert bf16.optimizer == pytest.approx(fp32.optimizer * 8 / 12)
    adam = next(op for op in build_schedule(_job("none", optimizer_dtype="bf16")).program(0).ops
                if op.kind == "optimizer")
    adam32 = next(op for op in build_schedule(_job("none")).program(0).ops if op.kind == "optimizer")
    # fused Adam: master r/w 8 B, momentum and variance r/w 2 x 2 x 2 B (not 2 x 2 x 4), 2e B
    assert adam.bytes / adam.shape[0] == 8 + 8 + 4 and adam32.bytes / adam32.shape[0] == 24 + 4


def test_mxfp8_on_a_blackwell_preset():
    from tests.schedule.helpers import preset_job

    job = preset_job("fsdp", "llama3_8b", "dgx_b200", 8, "parallel.float8=mxfp8",
                     "model.num_layers=2")
    gemms = {op.dtype for op in build_schedule(job).program(0).ops if op.kind == "gemm"}
    assert gemms == {"mxfp8", "bf16"} and job.peak_dtype == "mxfp8"


def test_compile_takes_the_eager_factor_out_of_elementwise_ops():
    """parallel.compile: an elementwise op is one fused kernel, its memory efficiency times
    the profile's eager factor (capped at 1), its host time over it; nothing else moves."""
    from paratwin.config import CONF_DIR

    job = _job("tensorwise", compile=True)
    eager = CostModel.load(CONF_DIR / "profiles" / "dgx_h100.yaml")
    fused = eager.compiled()
    f = eager.eager_elementwise
    assert f > 3  # the H100 profile folds eager PyTorch's extra elementwise kernels in
    assert fused.elementwise.mem_efficiency == pytest.approx(min(1.0, eager.elementwise.mem_efficiency * f))
    assert fused.elementwise.host_us == pytest.approx(eager.elementwise.host_us / f)
    assert fused.gemm == eager.gemm and fused.compiled() is fused
    plain = CostModel()
    assert plain.eager_elementwise == 1.0 and plain.compiled() is plain
    cast = next(op for op in build_schedule(job).program(0).ops if op.name.endswith("fp8_cast"))
    assert fused.compute_time(cast, H100) < eager.compute_time(cast, H100)


def test_compile_prices_its_reductions_at_the_profiles_share_of_the_fused_bandwidth():
    """Under parallel.compile the norms and the loss (Op.reduction) reach
    compiled_reduction_efficiency of the fused elementwise bandwidth (the H100 profile: 0.5,
    torch.compile's norms at ~50% of Quack's); other elementwise ops the whole of it; eager
    PyTorch prices both alike (its eager factor)."""
    from paratwin.config import CONF_DIR

    eager = CostModel.load(CONF_DIR / "profiles" / "dgx_h100.yaml")
    fused = eager.compiled()
    r = eager.compiled_reduction_efficiency
    assert r == 0.5 and eager.reduction_efficiency == 1.0 and fused.reduction_efficiency == r
    ops = build_schedule(_job("none", compile=True)).program(0).ops
    reductions = {op.name.rsplit("/", 1)[1] for op in ops if op.reduction}
    assert reductions == {"norm1", "norm2", "norm1.bwd", "norm2.bwd", "final_norm",
                          "final_norm.bwd", "loss", "loss.bwd"}
    norm = next(op for op in ops if op.name.endswith("/norm1"))
    act = next(op for op in ops if op.name.endswith("/act"))
    assert fused.kernel_of(norm).mem_efficiency == pytest.approx(
        fused.kernel_of(act).mem_efficiency * r)
    assert eager.kernel_of(norm) == eager.kernel_of(act)


def test_fsdp_gathers_fp8_weights_at_one_byte():
    """float8_fsdp_all_gather: each layer unit's gather moves its FP8 linears' weights at one
    byte per element (the rest, norms and biases, at e), closed form = schedule."""
    from collections import defaultdict

    from twin.workload.comm import step_traffic
    from twin.workload.params import layer_tensors

    plain = _job(zero_stage=3, global_batch_size=16)
    job = _job(zero_stage=3, global_batch_size=16, float8_fsdp_all_gather=True)
    ag = [[op for op in build_schedule(j).program(0).ops if op.kind == "all_gather"]
          for j in (plain, job)]
    fp8 = sum(t.numel for t in layer_tensors(job.model, 1)
              if t.name.endswith(".weight") and "norm" not in t.name)
    for a, b in zip(*ag):
        if a.layer >= 0:
            assert a.bytes - b.bytes == fp8 * (2 - 1)
        else:
            assert a.bytes == b.bytes  # the root (embedding, head) stays bf16
    got = defaultdict(float)
    for op in build_schedule(job).program(0).ops:
        if op.is_collective and op.group_name == "dp":
            got[op.kind] += op.bytes
    want = {k: b for k, (_, b) in step_traffic(job, 0)["dp"].calls.items()}
    assert got == pytest.approx(want)
    with pytest.raises(ConfigError, match="needs float8=tensorwise and zero_stage=3"):
        _job(float8_fsdp_all_gather=True)


def test_op_sac_recomputes_the_key_projection_in_fp8():
    """torchtitan's op-level SAC recomputes wk's output, a Float8Linear like the others: the
    recomputed k_proj runs at the FP8 peak after its cast."""
    from tests.conftest import gpt as model

    m = model(num_layers=2, activation="swiglu", position_embedding="rope")
    job = build_job(m, dataclasses.replace(cluster(), gpu=H100),
                    ParallelPlan(float8="tensorwise", recompute="op", global_batch_size=8))
    ops = {op.name: op for op in build_schedule(job).program(0).ops}
    k = [op for name, op in ops.items() if name.endswith("/k_proj")]
    assert k and all(op.dtype == "fp8" and name + ".fp8_cast" in ops for name, op in
                     ((op.name, op) for op in k))
