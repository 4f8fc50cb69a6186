"""The per-op passes rewritten for speed give what they gave before: the host's plan
(twin/sim/host.py) is the one the original loop over every op builds, and the critical
path's members of each call and predecessors on each stream (twin/sim/critical.py, now
looked up when the walk needs them) are the tables it built for every op up front."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from tests.sim.test_build_speedups import PLANS, _job
from twin.cost import default_cost_model
from twin.schedule.builder import build_schedule
from twin.sim.critical import _before, _Calls
from twin.sim.engine import SimOptions, Simulation, fold_classes
from twin.sim.host import host_plan
from twin.vocab import P2P_KINDS


def _host_plan_as_it_was(ops, cost):
    """twin.sim.host.host_plan as it was: one loop over the timed ops, a batch's end found
    by looking at the next timed op."""
    host = [cost.host_time(op) for op in ops]
    pipe = [op.kind in P2P_KINDS and op.group_name in ("pp", "") for op in ops]
    sync = cost.p2p_host_sync and any(pipe)
    if not sync and not any(host):
        return None
    sync_of = [-1] * len(ops)
    waits = {}
    last_of_stream = {}
    current = -1
    timed = [i for i, op in enumerate(ops) if op.stream != "mem"]
    for k, i in enumerate(timed):
        sync_of[i] = current
        op = ops[i]
        last_of_stream[op.stream if op.kind not in P2P_KINDS else f"p2p{i}"] = i
        if sync and pipe[i] and (k == len(timed) - 1 or not pipe[timed[k + 1]]):
            waits[i] = tuple(sorted(set(last_of_stream.values())))
            last_of_stream = {s: j for s, j in last_of_stream.items() if not s.startswith("p2p")}
            current = i
    return list(itertools.accumulate(host)), sync_of, waits


def _costs(job):
    base = default_cost_model(job.cluster)
    host = dict(host_comm_us=17.0, host_comm_per_rank_us=0.5,
                gemm=dataclasses.replace(base.gemm, host_us=90.0),
                elementwise=dataclasses.replace(base.elementwise, host_us=12.0))
    # an eager factor folded in (the H100 profile's): one-kernel ops (FSDP2's copies) and
    # ops outside the compiled blocks cost the host differently from the layers' ops
    folded = dict(host, eager_elementwise=4.0)
    return [base, dataclasses.replace(base, p2p_host_sync=True),
            dataclasses.replace(base, **host), dataclasses.replace(base, p2p_host_sync=True, **host),
            dataclasses.replace(base, **folded), dataclasses.replace(base, **folded).compiled()]


@pytest.mark.parametrize("name", PLANS)
def test_host_plan_is_the_one_loop_over_every_op(name):
    job = _job(name)
    programs = build_schedule(job).programs()
    for cost in _costs(job):
        for prog in programs.values():
            got = host_plan(prog.ops, cost)
            want = _host_plan_as_it_was(prog.ops, cost)
            assert (got is None) == (want is None)
            if got is not None:
                assert (got.issue_s, got.sync_of, got.waits) == want


@pytest.mark.parametrize("name", ["tp4 pp2 1f1b full", "interleaved full sp", "zb_v full",
                                  "moe ep2", "async tp", "ddp"])
def test_members_and_predecessors_are_the_tables_built_up_front(name):
    job = _job(name)
    classes = fold_classes(job, "all")
    schedule = build_schedule(job)
    sim = Simulation(job, {r: schedule.program(r) for r in classes},
                     default_cost_model(job.cluster), SimOptions(fold="all"), classes)
    sim.run()
    members: dict[tuple, list] = {}  # critical_path's tables as they were
    for r, prog in sim.programs.items():
        for k, op in enumerate(prog.ops):
            if op.is_collective:
                members.setdefault(("c", op.group, op.name), []).append((r, k))
            elif op.is_p2p and op.peer not in sim.programs:  # its mirror (sendrecv.py)
                members.setdefault(("m", r, op.tag), []).append((r, k))
            elif op.is_p2p:
                src, dst = (r, op.peer) if op.kind == "send" else (op.peer, r)
                members.setdefault(("p", src, dst, op.tag), []).append((r, k))
    calls = _Calls(sim.programs)
    for r, prog in sim.programs.items():
        st = sim.structure_of(r)
        prev = {}
        for idx in st.streams.values():
            prev.update(zip(idx[1:], idx))
        for k, op in enumerate(prog.ops):
            assert _before(st, op, k) == prev.get(k)
            if op.is_collective:
                assert calls.members(r, op) == members[("c", op.group, op.name)]
            elif op.is_p2p and op.peer not in sim.programs:
                assert calls.members(r, op) == members[("m", r, op.tag)]
            elif op.is_p2p:
                src, dst = (r, op.peer) if op.kind == "send" else (op.peer, r)
                assert calls.members(r, op) == members[("p", src, dst, op.tag)]
