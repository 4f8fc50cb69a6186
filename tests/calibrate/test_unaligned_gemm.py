"""GEMMs whose n or k is not a multiple of 16 bytes' elements lose efficiency (cuBLAS's
tensor-core kernels need aligned leading dimensions): the cost model's closed form, and the
factor fitted from a kernel sweep's unaligned rows."""

from __future__ import annotations

import csv

import pytest

from executor.bench.report import KERNEL_COLUMNS
from twin.calibrate.profile import build_profile
from twin.cost import CostModel, KernelCost
from twin.kernelshape import gemm_aligned
from twin.schedule.ir import Op
from twin.spec import ClusterSpec, GPUSpec

GPU = GPUSpec(name="g", peak_tflops={"bf16": 1000.0, "fp32": 100.0}, hbm_bw_GBps=1e9)


def gemm(m, n, k, dtype="bf16") -> Op:
    return Op(name="g", kind="gemm", stream="compute", shape=(m, n, k), dtype=dtype,
              flops=2.0 * m * n * k, bytes=0.0)


def test_alignment_is_n_and_k_in_sixteen_bytes():
    assert gemm_aligned(gemm(8192, 50304, 768)) and not gemm_aligned(gemm(8192, 50257, 768))
    assert not gemm_aligned(gemm(8192, 768, 50257))  # k unaligned
    assert gemm_aligned(gemm(50257, 768, 768))  # m is no leading dimension
    assert not gemm_aligned(gemm(64, 4100, 64)) and gemm_aligned(gemm(64, 4100, 64, "fp32"))


def test_unaligned_gemm_time_closed_form():
    cost = CostModel(name="u", gemm=KernelCost(efficiency=0.8, launch_us=5.0, unaligned_efficiency=0.25))
    for op, eff in ((gemm(8192, 50304, 768), 0.8), (gemm(8192, 50257, 768), 0.2),
                    (gemm(8192, 768, 50257), 0.2), (gemm(50257, 768, 768), 0.8)):
        assert cost.compute_time(op, GPU) == pytest.approx(op.flops / (1e15 * eff) + 5e-6, rel=1e-12)
    # the default keeps every GEMM at its efficiency
    plain = CostModel(name="p", gemm=KernelCost(efficiency=0.8, launch_us=5.0))
    op = gemm(8192, 50257, 768)
    assert plain.compute_time(op, GPU) == pytest.approx(op.flops / 0.8e15 + 5e-6, rel=1e-12)


def test_sweep_fits_the_unaligned_share_from_its_unaligned_rows(tmp_path):
    truth = CostModel(name="t", gemm=KernelCost(efficiency=0.75, launch_us=6.0, unaligned_efficiency=0.2))
    shapes = [(1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (8192, 4096, 1024),
              (4096, 14336, 4096), (4096, 50257, 1024), (2048, 4100, 4096), (4096, 4096, 4100),
              (4100, 4096, 4096)]
    (tmp_path / "s").mkdir()
    with open(tmp_path / "s" / "kernels.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(KERNEL_COLUMNS)
        for m, n, k in shapes:
            op = gemm(m, n, k)
            t = truth.compute_time(op, GPU)
            w.writerow(["gemm", "bf16", f"{m}x{n}x{k}", op.flops, 0.0, t, t, t, 5, 0, 0, "gpu", ""])
    cluster = ClusterSpec(name="g", num_nodes=1, gpus_per_node=1, gpu=GPU)
    profile, report = build_profile(tmp_path / "s", cluster, "s", "bf16")
    k = profile.kernel("gemm", "bf16")
    assert k.efficiency == pytest.approx(0.75, rel=0.02)
    assert k.unaligned_efficiency == pytest.approx(0.2, rel=0.02)
    assert report["kernels"]["gemm/bf16"]["params"]["unaligned_efficiency"] == pytest.approx(0.2, rel=0.02)
    # a profile round trip keeps it
    path = tmp_path / "p.yaml"
    profile.save(path)
    assert CostModel.load(path).kernel("gemm", "bf16").unaligned_efficiency == pytest.approx(
        k.unaligned_efficiency)
