"""A GPU kernel sweep's host column becomes each kind's host_us; a CPU sweep's leaves it at 0."""

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
