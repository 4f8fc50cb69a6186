"""The derived H100 profile against torchtitan's published runs (benchmarks/h100_published.py).

Their parts' peak lies between H100 SXM's and NVL's (torchtitan's note), so at the SXM peak
the twin must be no slower than published, and at the NVL peak within the band the benchmark
measured (+5% to +19% over the ten rows; a model that drifts out of it fails). The effects the
table isolates must hold as published: 128 vs 8 GPUs, and async TP's gain.
"""

from __future__ import annotations

import pytest

from benchmarks.h100_published import PEAKS, ROWS, predict

FAST = {label: (ov, tps) for label, ov, tps in ROWS if "405B" not in label}  # (405B: ~15 s)


def _tps(label: str, end: str) -> float:
    s = predict(FAST[label][0], PEAKS[end])
    return s["tokens_per_s"] / s["world_size"]


@pytest.mark.parametrize("label", FAST)
def test_the_twin_brackets_the_published_run(label):
    tps = FAST[label][1]
    assert _tps(label, "SXM") >= tps  # the parts are no faster than an SXM H100
    assert 0.0 <= _tps(label, "NVL") / tps - 1 <= 0.20


def test_the_fsdp_degree_and_async_tp_move_throughput_as_published():
    ratio = _tps("T3 8B FSDP 128", "NVL") / _tps("T1 8B FSDP 8", "NVL")
    assert ratio == pytest.approx(5605 / 5762, rel=0.05)
    gain = _tps("T4 70B FSDP32 x TP8 +async TP", "NVL") / _tps("T4 70B FSDP32 x TP8", "NVL")
    assert 1.0 < gain <= 876 / 829 * 1.02


def test_the_held_out_h200_rows_stay_where_they_were_measured():
    """torchtitan's June 2025 H200 baseline (8B FSDP, compile + Float8, 32 and 64 GPUs), never
    used to derive the profile: the twin was +9.3% and +11.1% on TPS/GPU when they were read;
    its memory 55.9 GiB against 48.0 published (the allocator reserve and the loss's transient
    are the excess)."""
    from benchmarks.h100_published import H200_ROWS

    for label, overrides, tps in H200_ROWS:
        s = predict(overrides)
        assert 0.0 <= s["tokens_per_s"] / s["world_size"] / tps - 1 <= 0.15, label
