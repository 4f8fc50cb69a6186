"""The DGX H100/H200 profiles: they load, calibration=auto picks them for their clusters, each
derived parameter is what its cited figure implies (closed forms against the generator's
table, benchmarks/h100_profile.py), and the default job's MFU against the published band."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.h100_profile import (
    ADAMW_FUSED_BYTES,
    FIGURES,
    NDR_GBPS,
    NVLINK_GBPS,
    PEAK_BF16,
    default_job,
    derive,
    eager_inflation,
    unaligned_share,
)
from paratwin.config import CONF_DIR, load_profile, preset_cluster
from twin.cost import CostModel
from twin.sim.run import simulate

HBM = {"h100": 3350.0, "h200": 4800.0}


@pytest.fixture(scope="module")
def job():
    return default_job()


@pytest.fixture(scope="module", params=["h100", "h200"])
def gpu(request):
    return request.param


@pytest.fixture(scope="module")
def shipped(gpu):
    return CostModel.load(CONF_DIR / "profiles" / f"dgx_{gpu}.yaml")


def test_profiles_load_and_auto_picks_them(gpu, shipped):
    cluster = preset_cluster(f"dgx_{gpu}")
    assert shipped.name == f"dgx_{gpu}"
    assert shipped.cluster_mismatch(cluster) is None
    assert load_profile("auto", cluster).name == f"dgx_{gpu}"
    other = preset_cluster("dgx_a100")
    assert shipped.cluster_mismatch(other) is not None  # never picked for another cluster
    assert load_profile("auto", other).name != f"dgx_{gpu}"


def test_shipped_yaml_is_what_the_generator_derives(gpu, shipped, job):
    cost, notes = derive(gpu, job)
    for kind in ("gemm", "attention", "elementwise", "optimizer"):
        for field in ("efficiency", "mem_efficiency", "launch_us", "host_us", "tile",
                      "tile_exponent"):
            want = getattr(getattr(cost, kind), field)
            assert getattr(getattr(shipped, kind), field) == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert shipped.kernels_by_dtype.keys() == cost.kernels_by_dtype.keys() == {"fp8"}
    for dtype, kinds in cost.kernels_by_dtype.items():
        for kind, k in kinds.items():
            assert shipped.kernel(kind, dtype).efficiency == pytest.approx(k.efficiency, rel=1e-5)
    assert shipped.collective_fits.keys() == cost.collective_fits.keys()
    for key, fit in cost.collective_fits.items():
        assert shipped.collective_fits[key]["bw_GBps"] == pytest.approx(fit["bw_GBps"], rel=1e-5)
        assert shipped.collective_fits[key]["latency_us"] == pytest.approx(fit["latency_us"],
                                                                            rel=1e-5)
    text = (CONF_DIR / "profiles" / f"dgx_{gpu}.yaml").read_text()
    for line in text.splitlines():  # every number names its source
        if line.strip().startswith(("efficiency:", "mem_efficiency:", "bw_efficiency:")):
            assert "#" in line, line


def test_each_parameter_is_what_its_figure_implies(gpu, shipped, job):
    copy = FIGURES[f"hbm_copy_{gpu}_TBps"][0] * 1e3 / HBM[gpu]
    ew, opt = eager_inflation(job)
    # MAMF (a boost-clock burst) at the sustained clock of a power-saturated GEMM: MSMF over
    # MAMF measured together on 8 busy H200s (698.6 / 823.9); FP8 from its own MAMF row
    sustained = 698.6 / 823.9
    assert shipped.gemm.efficiency == pytest.approx(794.5 / PEAK_BF16 * sustained, rel=1e-5)
    fp8 = shipped.kernel("gemm", "fp8")
    assert fp8.efficiency == pytest.approx(1402.6 / 1979 * sustained, rel=1e-5)
    assert dataclasses.replace(fp8, efficiency=shipped.gemm.efficiency) == shipped.gemm
    assert shipped.gemm.tile == 128
    # measured on one H200 here: a GEMM of n = 50,257 ran at 129.7 TFLOP/s, its aligned twin
    # (n = 50,304) at 759.4; the fit's share over the three unaligned shapes is near that ratio
    assert shipped.gemm.unaligned_efficiency == pytest.approx(unaligned_share(), rel=1e-5)
    assert shipped.gemm.unaligned_efficiency == pytest.approx(129.682 / 759.439, rel=0.1)
    # the host's cost per op: the A100 fit's (a property of the host and framework)
    a100 = CostModel.load(CONF_DIR / "profiles" / "dgx_a100.yaml")
    for kind in ("gemm", "attention", "elementwise"):
        assert getattr(shipped, kind).host_us == pytest.approx(getattr(a100, kind).host_us, abs=0.05)
    assert shipped.optimizer.host_us == 500.0  # the A100 fit left its optimizer at its start
    assert shipped.gemm.mem_efficiency == pytest.approx(copy, rel=1e-5)
    assert shipped.elementwise.mem_efficiency == pytest.approx(copy / ew, rel=1e-5)
    assert shipped.optimizer.mem_efficiency == pytest.approx(copy * 28 / ADAMW_FUSED_BYTES,
                                                             rel=2e-3)
    assert shipped.intra.bw_efficiency == pytest.approx(370 / NVLINK_GBPS, rel=1e-5)
    assert shipped.inter.bw_efficiency == pytest.approx(47 / NDR_GBPS, rel=1e-5)
    # attention: FlashAttention-2 at s = 8k, forward (causal 333) and backward (318, 2.5x the
    # FLOPs) combined by time: 3.5 / (1/E_f + 2.5/E_b); the fit over 512..16k lands within 3%
    e_f, e_b = 333 / PEAK_BF16, 318 / PEAK_BF16
    scale = 329.3 / 327.9 if gpu == "h200" else 1.0
    assert shipped.attention.efficiency == pytest.approx(3.5 / (1 / e_f + 2.5 / e_b) * scale,
                                                         rel=0.03)
    # all-reduce over the 8 GPUs: the fit's busbw near the table's large-message plateau
    big = FIGURES[f"allreduce_busbw_{gpu}"][0][-1]
    ar = shipped.collective_fits["all_reduce/intra/8"]
    assert ar["bw_GBps"] * 14 / 8 == pytest.approx(big, rel=0.1)
    for n, busbw in FIGURES["allreduce_busbw_by_n"][0].items():
        if n != 8:
            assert shipped.collective_fits[f"all_reduce/intra/{n}"]["bw_GBps"] == \
                pytest.approx(busbw * n / (2 * (n - 1)))
    for n in range(2, 9):
        assert shipped.collective_fits[f"all_gather/intra/{n}"]["bw_GBps"] == \
            pytest.approx(350 * n / (n - 1))
        assert shipped.collective_fits[f"reduce_scatter/intra/{n}"]["bw_GBps"] == \
            pytest.approx(360 * n / (n - 1))
        assert shipped.collective_fits[f"all_gather/intra/{n}"]["latency_us"] == \
            pytest.approx(6.6 + (n - 1) * 0.6)


def test_h200_differs_by_its_hbm_only(job):
    h100, _ = derive("h100", job)
    h200, _ = derive("h200", job)
    assert h200.gemm.efficiency == h100.gemm.efficiency  # MAMF: "H200 is the same"
    assert h200.elementwise.mem_efficiency / h100.elementwise.mem_efficiency == \
        pytest.approx((4.01 / 4.8) / (2.90 / 3.35))
    assert h200.intra == h100.intra and h200.inter == h100.inter


def _default_mfu(cluster: str) -> float:
    j = default_job([f"cluster={cluster}"])
    return simulate(j, load_profile("auto", j.cluster)).summary["mfu"]


def test_default_job_mfu_below_the_published_defaults():
    # the derived profile removes most of the 66.6% of the published-figure defaults
    assert _default_mfu("dgx_h100") < 0.6


@pytest.mark.xfail(strict=True, reason=(
    "the default job (no activation checkpointing, 80 GB HBM3 parts at 700 W) lands at ~46.4% "
    "MFU, above the 35-45% published band; torchtitan's published runs (33.7% on 8 H100s) used "
    "op-level SAC on 500 W HBM2e parts whose peak lies 'between SXM and NVL': simulated so "
    "(recompute=op, 2.4 TB/s, peak 989..835 TFLOP/s; benchmarks/h100_published.py) the twin is "
    "+18%..+5% on tokens/s. The GEMMs run at the sustained (power-saturated) clock of a 700 W "
    "part (MSMF/MAMF) and 18.9% slower beside NCCL kernels (overlap_slowdown, arXiv:2507.03114); "
    "still missing: the lower clock a 500 W limit sustains"))
def test_default_job_mfu_in_published_band():
    assert 0.35 <= _default_mfu("dgx_h100") <= 0.45
