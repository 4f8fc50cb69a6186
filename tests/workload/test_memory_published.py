"""Peak memory per GPU against published figures (benchmarks/memory_published.py prints them).

Each figure is torchtitan's "Memory(GiB)" in benchmarks/llama3_h100_202412_torchtitan.md
(pytorch/torchtitan at b5bcd76): the caching allocator's peak reserved bytes
(``reserved_bytes.all.peak``, torchtitan/components/metrics.py), maximum over ranks, of
Llama 3.1 runs on H100s (96 GB HBM2e), held against ``Memory.reserved`` of the modelled rank
with the highest. Tolerance 10%; 15% for the 405B 3D run, whose stage split is not
published and which used Float8 all-gathers and async TP that the model does not have.
"""

from __future__ import annotations

import pytest

from benchmarks.memory_published import CASES, GIB, Case, row

BY_WHERE = {c.where: c for c in CASES}


def _check(case: Case) -> None:
    r = row(case)
    assert r["modelled_gib"] == pytest.approx(case.published_gib, rel=case.tolerance), r


def test_cases_cover_full_and_selective_recompute_and_fsdp_at_three_sizes():
    assert len(CASES) >= 5
    policies = {c.recompute or c.plan.recompute for c in CASES}
    assert {"op", "full"} <= policies
    assert {c.model.name for c in CASES if c.plan.zero_stage == 3} >= {
        "llama3.1_8B", "llama3.1_70B", "llama3.1_405B"}


def test_8b_fsdp8_selective_op_ac_table1():
    # Table 1: Llama 3.1 8B, 8 GPUs, FSDP, local batch 2, selective (op) AC: 82.4 GiB.
    _check(BY_WHERE["Table 1, row FSDP"])


def test_8b_fsdp128_selective_op_ac_table3():
    # Table 3: the same run on 128 GPUs: 67.0 GiB (model states shrink 16x).
    _check(BY_WHERE["Table 3, row FSDP"])


def test_fsdp_degree_moves_only_the_model_states():
    # 82.4 - 67.0 = 15.4 GiB published between FSDP-8 and FSDP-128; the model's difference is
    # the sharded states (16 Psi (1/8 - 1/128)) plus the allocator's reserve on them.
    (_, m8), (_, m128) = (BY_WHERE[w].modelled() for w in ("Table 1, row FSDP",
                                                          "Table 3, row FSDP"))
    assert (m8.reserved - m128.reserved) / GIB == pytest.approx(82.4 - 67.0, rel=0.10)
    assert m8.activations == m128.activations and m8.temporary == m128.temporary


def test_8b_fsdp8_full_ac_32k_table2():
    # Table 2: 8B, FSDP 8, CP 1, sequence 32,768, local batch 1, full AC: 83.9 GiB. The fp32
    # cross-entropy over 128,256 entries (temporary) is the largest category here.
    case = BY_WHERE["Table 2, row FSDP 8, CP 1"]
    _check(case)
    _, mem = case.modelled()
    assert mem.temporary == max(getattr(mem, c) for c in (
        "params", "grads", "optimizer", "activations", "buffers", "temporary"))


def test_70b_fsdp32_tp8_full_ac_table4():
    # Table 4: 70B, FSDP 32 x TP 8, local batch 16, full AC: 71.9 GiB.
    _check(BY_WHERE["Table 4, row 2D"])


def test_405b_3d_1f1b_full_ac_table5():
    # Table 5: 405B, FSDP 8 x TP 8 x PP 8, 1F1B, local batch 32 in 8 micro-batches, full AC:
    # 82.5 GiB. Under PP, FSDP neither reshards after forward nor syncs before the last
    # micro-batch, so every layer's unsharded gradient is held in fp32 (the reduce dtype).
    case = BY_WHERE["Table 5, row 1F1B"]
    _check(case)
    _, mem = case.modelled()
    assert mem.buffers == max(getattr(mem, c) for c in (
        "params", "grads", "optimizer", "activations", "buffers", "temporary"))


def test_the_tensors_alone_miss_every_figure():
    # Without the new categories the static model is 28-53% low on the four 1- and 2-D runs.
    for case in CASES[:4]:
        _, mem = case.modelled()
        assert mem.tensors / GIB < 0.75 * case.published_gib, case.name
