"""The IR round-trips through JSON, and the static checks catch broken schedules."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tests.conftest import cluster, gpt
from twin.schedule.builder import build_schedule
from twin.schedule.check import ScheduleError, check_schedule, walk
from twin.schedule.ir import Op, Program, Schedule
from twin.spec import ParallelPlan, build_job


@pytest.fixture(scope="module")
def sched3d():
    job = build_job(gpt(), cluster(gpus=8), ParallelPlan(tp=2, pp=2, sp=True, zero_stage=1,
                                                         global_batch_size=8))
    return build_schedule(job)


def test_json_round_trip_is_identical(sched3d, tmp_path):
    path = tmp_path / "s.json"
    sched3d.save(path, ranks=[0, 3])
    back = Schedule.load(path)
    assert back.job == sched3d.job
    for r in (0, 3):
        assert back.program(r).ops == sched3d.program(r).ops
    with pytest.raises(KeyError, match="rank 1 is not in this loaded schedule"):
        back.program(1)


def test_a_file_that_is_not_a_schedule_is_named(tmp_path):
    bad = tmp_path / "trace.json"
    bad.write_text(json.dumps({"traceEvents": []}))
    with pytest.raises(ValueError, match="not a paratwin schedule"):
        Schedule.load(bad)
    bad.write_text("{oops")
    with pytest.raises(ValueError, match="not JSON"):
        Schedule.load(bad)


def test_op_names_are_unique_and_stable(sched3d):
    for r in range(8):
        names = [op.name for op in sched3d.program(r).ops]
        assert len(names) == len(set(names))
    # two ranks of one TP group name their shared collectives identically
    tp0 = [op.name for op in sched3d.program(0).ops if op.group_name == "tp"]
    tp1 = [op.name for op in sched3d.program(1).ops if op.group_name == "tp"]
    assert tp0 == tp1 and tp0


def _programs(sched):
    return {r: Program(r, list(p.ops)) for r, p in sched.programs().items()}


def test_swapped_collectives_are_caught(sched3d):
    progs = _programs(sched3d)
    ops = progs[1].ops
    i, j = [k for k, op in enumerate(ops) if op.group_name == "tp"][:2]
    ops[i], ops[j] = ops[j], ops[i]
    with pytest.raises(ScheduleError, match="diverge"):
        check_schedule(progs)


def test_a_missing_recv_is_caught(sched3d):
    progs = _programs(sched3d)
    ops = progs[2].ops
    k = next(i for i, op in enumerate(ops) if op.kind == "recv")
    ops[k] = dataclasses.replace(ops[k], tag="nowhere")
    with pytest.raises(ScheduleError, match="no matching"):
        check_schedule(progs)


def test_walk_finds_a_cycle_across_groups():
    def ar(name, group):
        return Op(name=name, kind="all_reduce", stream="comm", group=group, bytes=4.0)
    progs = {0: Program(0, [ar("a", (0, 1)), ar("b", (0, 2))]),
             1: Program(1, [ar("c", (1, 2)), ar("a", (0, 1))]),
             2: Program(2, [ar("b", (0, 2)), ar("c", (1, 2))])}
    with pytest.raises(ScheduleError, match="deadlock: 6 ops cannot run"):
        walk(progs)


def test_walk_lets_p2p_overlap():
    # both ranks send first, then receive: fine with isend/irecv semantics
    def p2p(kind, peer, tag):
        return Op(name=f"{kind}{tag}", kind=kind, stream="p2p", peer=peer, tag=tag, bytes=8.0)
    progs = {0: Program(0, [p2p("send", 1, "x"), p2p("recv", 1, "y")]),
             1: Program(1, [p2p("send", 0, "y"), p2p("recv", 0, "x")])}
    assert walk(progs).ops == 4


def test_p2p_issued_out_of_order_is_caught():
    # NCCL pairs a direction's sends and recvs by issue order, not by tag
    def p2p(kind, peer, tag):
        return Op(name=f"{kind}{tag}", kind=kind, stream="p2p", peer=peer, tag=tag, bytes=8.0)
    progs = {0: Program(0, [p2p("send", 1, "a"), p2p("send", 1, "b")]),
             1: Program(1, [p2p("recv", 0, "b"), p2p("recv", 0, "a")])}
    with pytest.raises(ScheduleError, match="issued in different orders"):
        check_schedule(progs)
