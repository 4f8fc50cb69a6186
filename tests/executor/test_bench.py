"""`paratwin bench`: every IR collective over sizes and group sizes, kernels, stable CSV columns."""

from __future__ import annotations

import csv
import json

import pytest

pytest.importorskip("torch")

from executor.bench.collectives import KINDS, group_sizes, message_sizes  # noqa: E402
from executor.bench.report import COLLECTIVE_COLUMNS, KERNEL_COLUMNS, quantile  # noqa: E402
from tests.executor.helpers import paratwin  # noqa: E402
from twin.schedule.ir import COLLECTIVE_KINDS  # noqa: E402
from twin.vocab import busbw_factor  # noqa: E402


def rows(path):
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        return reader.fieldnames, list(reader)


def test_sweep_grids():
    assert message_sizes(4096, 2**28, 4) == [4096 * 4**i for i in range(9)]
    assert message_sizes(4096, 2**28, 4)[-1] == 2**28  # 4 KB to 256 MB
    assert group_sizes(8, None) == [2, 4, 8] and group_sizes(6, None) == [2, 4, 6]
    assert group_sizes(4, [4, 2, 2]) == [2, 4]
    assert set(COLLECTIVE_KINDS) | {"sendrecv"} == set(KINDS)
    assert quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.5) == 3.0


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_bench_writes_collectives_kernels_and_metadata(tmp_path):
    out = tmp_path / "bench"
    res = paratwin("bench", "world_size=3", "min_bytes=4096", "max_bytes=16384", "repeats=2",
                   "warmup=1", "kernel_repeats=2", "kernel_warmup=1", "kernels.dtypes=[fp32]",
                   "kernels.gemm=[[32,16,8]]", "kernels.attention=[[1,2,1,32,16]]",
                   "kernels.elementwise=[1024]", "kernels.optimizer=[1024]", "format=json",
                   f"out_dir={out}", timeout=110)
    assert res.returncode == 0, res.stderr
    result = json.loads(res.stdout)
    cols, coll = rows(out / "collectives.csv")
    assert cols == COLLECTIVE_COLUMNS
    # every kind x 2 sizes x group sizes 2 and 3 (rank 2 idles for the groups of 2)
    assert {(r["kind"], int(r["group_size"]), int(r["bytes"])) for r in coll} == {
        (k, g, b) for k in KINDS for g in (2, 3) for b in (4096, 16384)}
    for r in coll:
        t = float(r["time_s_median"])
        assert 0 < float(r["time_s_p10"]) <= t <= float(r["time_s_p90"])
        assert float(r["algbw_GBps"]) == pytest.approx(int(r["bytes"]) / t / 1e9, rel=1e-4)
        assert float(r["busbw_GBps"]) == pytest.approx(
            float(r["algbw_GBps"]) * busbw_factor(r["kind"], int(r["group_size"])), rel=1e-4)
        assert r["repeats"] == "2" and r["backend"] == "gloo"
    cols, kern = rows(out / "kernels.csv")
    assert cols == KERNEL_COLUMNS
    assert [r["kind"] for r in kern] == ["gemm", "attention", "attention.bwd", "elementwise",
                                         "optimizer"]
    gemm = kern[0]
    assert gemm["shape"] == "32x16x8" and float(gemm["flops"]) == 2 * 32 * 16 * 8
    assert all(r["host_s_median"] == "" for r in kern)  # on CPU the call is the host's work
    assert float(gemm["tflops"]) == pytest.approx(
        float(gemm["flops"]) / float(gemm["time_s_median"]) / 1e12, rel=1e-4)
    meta = result["meta"]
    for key in ("host", "cpu", "gpus", "torch_version", "backend", "world_size", "date"):
        assert key in meta
    assert meta["world_size"] == 3 and meta["group_sizes"] == [2, 3]


@pytest.mark.timeout(60)
def test_bench_config_errors_are_one_line(tmp_path):
    res = paratwin("bench", "collectives=[all_reduce,barrier]", "step_factor=1",
                   f"out_dir={tmp_path / 'x'}")
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1
    assert "barrier" in res.stderr and "step_factor=1" in res.stderr
    assert not (tmp_path / "x").exists()
