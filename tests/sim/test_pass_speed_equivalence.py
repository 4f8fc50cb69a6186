"""The per-op passes rewritten for speed give what they gave before: the host's plan
(twin/sim/host.py), the streams and base times (twin/sim/walks.py) and the op table
(twin/sim/stats.py), worked out per op signature (twin/sim/codes.py, stamped bodies coded
from their first copy), are the ones the original loops over every op build, and the critical
path's members of each call and predecessors on each stream (twin/sim/critical.py, now
looked up when the walk needs them) are the tables it built for every op up front."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from tests.sim.test_build_speedups import PLANS, _job
from twin.cost import default_cost_model
from twin.schedule.builder import build_schedule
from twin.schedule.ir import Op, Program
from twin.sim.codes import codes_of, op_codes
from twin.sim.critical import _before, _Calls
from twin.sim.engine import SimOptions, Simulation, fold_classes
from twin.sim.host import host_plan
from twin.sim.stats import op_table
from twin.sim.walks import structure
from twin.vocab import COMPUTE_KINDS, MEMORY_KINDS, P2P_KINDS, PIPELINE_PHASES


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


def _structure_as_it_was(ops, compute_time):
    """twin.sim.walks.structure as it was: (streams, base times, compute flags, memory ops)
    by one loop over every op."""
    streams, memory, base = {}, [], [0.0] * len(ops)
    for i, op in enumerate(ops):
        if op.stream == "mem":
            memory.append(i)
            continue
        streams.setdefault(op.stream, []).append(i)
        if op.kind in COMPUTE_KINDS:
            base[i] = compute_time(op)
    return list(streams.items()), base, [op.kind in COMPUTE_KINDS for op in ops], memory


def _table_as_it_was(ops):
    """twin.sim.stats.op_table's columns as they were, op by op."""
    compute = np.array([op.kind in COMPUTE_KINDS for op in ops], dtype=bool)
    memory = np.array([op.kind in MEMORY_KINDS for op in ops], dtype=bool)
    alloc = np.array([op.kind == "alloc" for op in ops], dtype=bool)
    pipe = np.array([op.phase in PIPELINE_PHASES for op in ops], dtype=bool)
    names, group, pp = {}, np.full(len(ops), -1, dtype=np.int64), np.zeros(len(ops), bool)
    for i, op in enumerate(ops):
        if not (compute[i] or memory[i]):
            calls = op.kind in P2P_KINDS or op.is_collective
            role = op.group_name if calls else ""
            group[i] = names.setdefault(role or op.kind, len(names))
            pp[i] = role == "pp"
    nbytes = np.array([op.bytes if memory[i] else 0.0 for i, op in enumerate(ops)], dtype=float)
    return (compute, ~memory, compute & pipe, group, tuple(names), ~memory & ~compute & ~pp & pipe,
            memory, alloc, np.where(alloc, nbytes, -nbytes))


def _same_table(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if isinstance(w, np.ndarray):
            assert g.dtype == w.dtype and np.array_equal(g, w)
        else:
            assert g == w


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
            want = _host_plan_as_it_was(prog.ops, cost)
            for codes in (None, op_codes(prog)):  # per op, and with the bodies tiled
                got = host_plan(prog.ops, cost, codes)
                assert (got is None) == (want is None)
                if got is not None:
                    assert (got.issue_s, got.sync_of, got.waits) == want


@pytest.mark.parametrize("name", PLANS)
def test_streams_base_times_and_the_op_table_are_the_loops_over_every_op(name):
    job = _job(name)
    cost, gpu = default_cost_model(job.cluster), job.cluster.gpu
    for prog in build_schedule(job).programs().values():
        want = _structure_as_it_was(prog.ops, lambda op: cost.compute_time(op, gpu))
        table = _table_as_it_was(prog.ops)
        for codes in (None, op_codes(prog)):
            st = structure(prog.ops, lambda op: cost.compute_time(op, gpu), None, codes)
            assert (list(st.streams.items()), st.base_s, st.is_compute, st.memory) == want
            _same_table(op_table(prog.ops, codes), table)


def test_signatures_tile_stamped_bodies_as_coding_each_op_does():
    """The codes tiled from each stamped body's first copy group the ops exactly as coding
    every op one by one does (the same partition, numbered differently)."""
    job = _job("interleaved full sp")
    for prog in build_schedule(job).programs().values():
        assert prog.blocks
        tiled, each = op_codes(prog), codes_of(prog.ops)
        pairs = set(zip(tiled.code.tolist(), each.code.tolist()))
        assert len(pairs) == len(tiled.reps) == len(each.reps)
        assert op_codes(prog) is tiled  # kept on the program


def test_a_stream_named_like_the_sends_and_an_empty_program():
    """A loaded schedule's stream named p2p... (not a send/recv) is forgotten at each sync
    point as the loop's keys had it; a program without ops has an empty plan."""
    cost = dataclasses.replace(default_cost_model(_job("ddp").cluster), p2p_host_sync=True,
                               host_comm_us=5.0)
    ops = [Op("a", "gemm", "p2pish", flops=1.0), Op("r", "recv", "p2p", peer=1, tag="t"),
           Op("m", "alloc", "mem", bytes=4.0), Op("s", "send", "p2p", peer=1, tag="u"),
           Op("b", "gemm", "compute", flops=1.0), Op("r2", "recv", "p2p", peer=1, tag="v"),
           Op("c", "gemm", "compute", flops=1.0), Op("x", "send", "p2p", peer=1, tag="w",
                                                      group_name="tp"),
           Op("r3", "recv", "p2p", peer=1, tag="y")]
    want = _host_plan_as_it_was(ops, cost)
    got = host_plan(ops, cost)
    assert (got.issue_s, got.sync_of, got.waits) == want
    assert got.waits == {3: (0, 1, 3), 5: (4, 5), 8: (6, 7, 8)}
    assert host_plan([], cost) is None
    empty = Program(0, [])
    assert structure([], lambda op: 0.0, None, op_codes(empty)).streams == {}
    _same_table(op_table([]), _table_as_it_was([]))


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
