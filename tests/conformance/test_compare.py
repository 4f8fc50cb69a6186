"""The inventory comparison on hand-made inventories: counts, bytes, order, rules, p2p."""

from __future__ import annotations

from executor.conformance.compare import Entry, compare, group_name, ir_entries, table, torch_entries
from tests.conftest import cluster
from twin.spec import ModelSpec, ParallelPlan, build_job


def tiny(**kw) -> ModelSpec:
    base = dict(name="tiny", num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2,
                ffn_hidden_size=128, vocab_size=512, seq_len=64, activation="swiglu", dtype="fp32")
    return ModelSpec(**{**base, **kw})


def job(gpus=2, **plan):
    return build_job(tiny(), cluster(gpus=gpus), ParallelPlan(**plan))


AR = Entry((0, 1), "all_reduce", 16)
AG = Entry((0, 1), "all_gather", 32)


def test_equal_inventories_have_no_difference():
    assert compare(job(tp=2), 0, [AR, AG, AR], [AR, AG, AR]) == []


def test_a_missing_call_is_a_count_difference_naming_group_and_bytes():
    (d,) = compare(job(tp=2), 0, [AR, AR], [AR])
    assert (d.what, d.group_name, d.kind, d.ir_count, d.ir_bytes, d.torch_count, d.torch_bytes) == \
        ("count", "tp", "all_reduce", 2, 32, 1, 16)
    assert d.rule == ""


def test_same_count_other_bytes_is_a_bytes_difference():
    (d,) = compare(job(tp=2), 0, [AR], [Entry((0, 1), "all_reduce", 20)])
    assert d.what == "bytes"


def test_collective_order_matters_within_a_group_and_across_kinds():
    (d,) = compare(job(tp=2), 0, [AR, Entry((0, 1), "all_reduce", 4)],
                   [Entry((0, 1), "all_reduce", 4), AR])
    assert d.what == "order"
    (d,) = compare(job(tp=2), 0, [AR, AG], [AG, AR])
    assert (d.what, d.kind) == ("order", "*") and "first differs at call 0" in d.note


def test_send_recv_order_is_not_compared():
    s, r = Entry((0, 1), "send", 8), Entry((0, 1), "recv", 8)
    assert compare(job(pp=2), 0, [s, r, s], [s, s, r]) == []


def test_documented_rule_explains_fsdp2_sp_norm_gradients_order_only():
    j = job(gpus=4, tp=2, sp=True, zero_stage=3)
    norm = Entry((0, 1), "all_reduce", 256)
    rs = Entry((0, 1), "reduce_scatter", 1024)
    (d,) = compare(j, 0, [rs, norm], [norm, rs])
    assert d.what == "order" and d.rule == "fsdp2-sp-norm-grads-in-backward"
    (d,) = compare(j, 0, [rs, norm], [rs])  # a missing call is never excused by it
    assert d.rule == ""


def test_group_names_come_from_the_grid():
    j = job(gpus=4, tp=2, pp=2, global_batch_size=8)
    assert group_name(j, 0, (0, 1), "all_reduce") == "tp"
    assert group_name(j, 0, (0, 2), "all_reduce") == "pp"
    assert group_name(j, 0, (0, 1, 2, 3), "all_reduce") == "tp-pp"
    assert group_name(j, 0, (0, 2), "send") == "pp"


def test_ir_and_torch_entries_use_the_same_keys():
    from twin.schedule.builder import build_schedule

    j = job(pp=2, pp_schedule="gpipe", global_batch_size=2)
    ir = ir_entries(build_schedule(j).program(0))
    assert table(ir) == {((0, 1), "send"): (2, 2 * 64 * 64 * 4), ((0, 1), "recv"): (2, 2 * 64 * 64 * 4),
                         ((0, 1), "all_reduce"): (1, 4)}
    calls = [{"step": 1, "kind": "send", "group": [0, 1], "peer": 1, "bytes": 16384},
             {"step": 0, "kind": "all_reduce", "group": [0, 1], "peer": -1, "bytes": 4}]
    assert torch_entries(calls, 1, 0) == [Entry((0, 1), "send", 16384)]
