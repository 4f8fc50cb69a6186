"""Compute ops run as real kernels of their shapes; memory ops allocate, free and count."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from executor.kernels import Kernels, attention_flops, torch_dtype, workspace_estimate  # noqa: E402
from executor.memory import MemoryPool  # noqa: E402
from twin.schedule.builder import build_schedule  # noqa: E402
from twin.schedule.ir import Op  # noqa: E402
from twin.spec import ClusterSpec, GPUSpec, ModelSpec, ParallelPlan, build_job  # noqa: E402


def tiny_program(**plan):
    model = ModelSpec(name="tiny", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                      ffn_hidden_size=128, vocab_size=512, seq_len=64, activation="swiglu",
                      dtype="fp32")
    cluster = ClusterSpec(name="c", num_nodes=1, gpus_per_node=2,
                          gpu=GPUSpec(name="cpu", peak_tflops={"fp32": 0.1}))
    job = build_job(model, cluster, ParallelPlan(**plan))
    return build_schedule(job).program(0)


def test_every_compute_op_of_a_program_runs_and_the_estimate_bounds_the_workspace():
    prog = tiny_program(tp=2, sp=True)
    torch.set_num_threads(1)
    k = Kernels(torch.device("cpu"))
    kinds = set()
    for op in prog.ops:
        if op.is_compute:
            k.run(op)
            kinds.add(op.kind)
    assert kinds == {"gemm", "attention", "elementwise", "optimizer"}
    assert 0 < k.workspace_bytes <= workspace_estimate(prog.ops)


def test_attention_backward_runs_the_sdpa_backward():
    shape = (1, 4, 2, 32, 16, 1)
    k = Kernels(torch.device("cpu"))
    fwd = Op("a", "attention", "compute", shape=shape, dtype="fp32", flops=attention_flops(shape))
    bwd = Op("a.bwd", "attention", "compute", shape=shape, dtype="fp32",
             flops=2.5 * attention_flops(shape), phase="bwd")
    k.run(fwd)
    k.run(bwd)
    kinds = {key[-1] for key in k._cache if key[0] == "attention"}
    assert kinds == {False, True}  # one forward input set, one autograd graph
    q = next(v for key, v in k._cache.items() if key[0] == "attention" and key[-1])[0]
    assert q.requires_grad


def test_gemm_output_is_the_product():
    k = Kernels(torch.device("cpu"))
    k.gemm((8, 4, 16), "fp32")
    a, b, c = k._cache[("gemm", 8, 4, 16, "fp32")]
    assert torch.allclose(c, a @ b)


def test_memory_pool_counts_live_and_peak_and_rejects_mismatches():
    pool = MemoryPool(torch.device("cpu"))
    pool.apply(Op("alloc.x", "alloc", "mem", bytes=100, tag="x"))
    pool.apply(Op("alloc.y", "alloc", "mem", bytes=50, tag="y"))
    pool.apply(Op("free.x", "free", "mem", bytes=100, tag="x"))
    assert (pool.live_bytes, pool.peak_bytes) == (50, 150)
    with pytest.raises(RuntimeError, match="never allocated"):
        pool.apply(Op("free.z", "free", "mem", bytes=1, tag="z"))
    with pytest.raises(RuntimeError, match="already allocated"):
        pool.apply(Op("alloc.y2", "alloc", "mem", bytes=1, tag="y"))
    pool.reset()
    assert (pool.live_bytes, pool.peak_bytes) == (0, 0)


def test_dtype_names():
    assert torch_dtype("bf16") is torch.bfloat16 and torch_dtype("") is torch.float32
    with pytest.raises(ValueError, match="fp4"):
        torch_dtype("fp4")


def test_a_foreach_optimizer_op_runs_pytorchs_foreach_adam():
    prog = tiny_program(dp=2, optimizer_kernels="foreach")
    (op,) = [o for o in prog.ops if o.kind == "optimizer"]
    assert op.shape[1] == 0
    k = Kernels(torch.device("cpu"))
    k.run(op)
    (opt,) = [v for key, v in k._cache.items() if key[0] == "optimizer"]
    assert opt.defaults["foreach"] is True and not opt.defaults.get("fused")
