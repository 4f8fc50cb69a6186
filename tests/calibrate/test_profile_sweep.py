"""Profiles fitted to kernel sweeps: the host column of a GPU sweep, causal attention."""

from __future__ import annotations

import csv

import pytest

from executor.bench.report import KERNEL_COLUMNS
from twin.calibrate.profile import build_profile
from twin.spec import ClusterSpec, GPUSpec


def _sweep(path, host: dict[str, list[float]] | None):
    """A kernels.csv of gemm and elementwise rows on a 1 TFLOP/s, 1 TB/s device: times of the
    cost model's shape, host seconds per call from ``host`` (kind -> one per row) or empty."""
    path.mkdir()
    rows = []
    for i, n in enumerate((64, 128, 256, 512)):
        flops, nbytes = 2.0 * n ** 3, 2.0 * 3 * n * n
        rows.append({"kind": "gemm", "dtype": "bf16", "shape": f"{n}x{n}x{n}", "flops": flops,
                     "bytes": nbytes, "time_s": flops / 0.7e12 + 5e-6, "host": "gemm", "i": i})
        elements = 1 << (16 + 2 * i)
        rows.append({"kind": "elementwise", "dtype": "bf16", "shape": f"{elements}", "flops": elements,
                     "bytes": 6.0 * elements, "time_s": 6.0 * elements / 0.8e12 + 3e-6,
                     "host": "elementwise", "i": i})
    with open(path / "kernels.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(KERNEL_COLUMNS)
        for r in rows:
            t = r["time_s"]
            h = host[r["host"]][r["i"]] if host else ""
            w.writerow([r["kind"], r["dtype"], r["shape"], r["flops"], r["bytes"], t, t * 0.99,
                        t * 1.01, 5, 0, 0, "gpu" if host else "cpu", h])


@pytest.fixture
def gpu():
    return ClusterSpec(name="g", num_nodes=1, gpus_per_node=1,
                       gpu=GPUSpec(name="g", peak_tflops={"bf16": 1.0}, hbm_bw_GBps=1000.0))


def test_host_column_sets_each_kinds_host_us_to_its_median(tmp_path, gpu):
    _sweep(tmp_path / "gpu", {"gemm": [9e-6, 11e-6, 10e-6, 30e-6],
                              "elementwise": [7e-6, 6e-6, 8e-6, 7e-6]})
    profile, report = build_profile(tmp_path / "gpu", gpu, "g", "bf16")
    assert profile.kernel("gemm", "bf16").host_us == pytest.approx(10.5)
    assert profile.kernel("elementwise", "bf16").host_us == pytest.approx(7.0)
    assert report["kernels"]["gemm/bf16"]["params"]["host_us"] == pytest.approx(10.5)
    # the kernel times themselves fit as without the column: the launch term is the GPU's
    assert profile.kernel("gemm", "bf16").launch_us == pytest.approx(5.0, rel=0.05)


def test_without_host_times_host_us_stays_zero(tmp_path, gpu):
    _sweep(tmp_path / "cpu", None)
    profile, report = build_profile(tmp_path / "cpu", gpu, "c", "bf16")
    assert profile.kernel("gemm", "bf16").host_us == 0.0
    assert "host_us" not in report["kernels"]["gemm/bf16"]["params"]


def test_causal_attention_fits_by_the_flops_it_is_timed_by(tmp_path, gpu):
    """A causal attention kernel does half the FLOPs its op counts (cost.timed_flops): rows
    timed by the cost model with E = 0.6, L = 20 us fit back to those, forward and backward."""
    from twin.cost import CostModel, KernelCost
    from twin.schedule.ir import Op

    truth = CostModel(name="t", attention=KernelCost(efficiency=0.6, launch_us=20.0))
    (tmp_path / "attn").mkdir()
    with open(tmp_path / "attn" / "kernels.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(KERNEL_COLUMNS)
        for batch, heads, seq, d in ((1, 8, 1024, 64), (2, 16, 2048, 64), (1, 32, 4096, 128),
                                     (4, 32, 2048, 128)):
            shape = (batch, heads, heads, seq, d, 1)
            for kind, scale in (("attention", 1.0), ("attention.bwd", 2.5)):
                flops = 4.0 * batch * heads * seq * seq * d * scale
                op = Op(name="a", kind="attention", stream="compute", shape=shape, dtype="bf16",
                        flops=flops, bytes=0.0)
                t = truth.compute_time(op, gpu.gpu)
                w.writerow([kind, "bf16", "x".join(map(str, shape)), flops, 0.0, t, t, t, 5, 0, 0,
                            "gpu", ""])
    profile, report = build_profile(tmp_path / "attn", gpu, "a", "bf16")
    fitted = profile.kernel("attention", "bf16")
    assert fitted.efficiency == pytest.approx(0.6, rel=0.02)
    assert fitted.launch_us == pytest.approx(20.0, rel=0.05)
    assert report["kernels"]["attention/bf16"]["residual_median"] < 0.01
