"""Ranks on CPU cores: the host thread is the compute thread.

A GPU rank's host runs ahead of its device, issuing ops (twin.sim.host). A rank that is a
process on CPU cores (``shared_cpu``) has no device to run ahead: its thread runs the
kernels itself, so the host time of a collective or send/recv (dispatch, the framework's
hooks around it, handing the buffer to gloo) is time that thread does not compute. Each
such call's host time (``CostModel.host_time``: per call by its group's role, per member)
is put on the compute op the thread runs next in program order (the last one for calls
after every compute op), and the issue timeline carries none of it (``issue_cost``). So is
the host time a tensor-parallel GEMM adds (``CostModel.host_tp_gemm_us``: DTensor's dispatch),
on that GEMM itself.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

from twin.cost import CostModel, call_role
from twin.schedule.ir import Op


@dataclass(frozen=True)
class Charge:
    """The calls a compute op's thread issues just before it, and their host time."""

    seconds: float
    calls: tuple[tuple[str, int], ...]
    """(group role, calls): each costs ``CostModel.comm_host_us(role)``."""
    members: int
    """Their collectives' group members summed (each ``host_comm_per_rank_us``)."""
    tp_gemm: bool = False
    """The op is a tensor-parallel GEMM: its thread pays ``host_tp_gemm_us`` first."""


def thread_charges(ops: list[Op], cost: CostModel) -> dict[int, Charge]:
    """Compute op -> the Charge of the calls issued between it and the compute op before
    it, and of its own DTensor dispatch if it is a TP GEMM (counted at zero cost too: a fit
    re-times them through the critical path). A call's seconds are its ``host_time``."""
    pending: list[Op] = []
    out: dict[int, list[Op]] = {}
    last = -1
    for i, op in enumerate(ops):
        if op.is_collective or op.is_p2p:
            pending.append(op)
        elif op.is_compute:
            last = i
            if pending or op.tp_gemm:
                out[i], pending = pending, []
    if pending and last >= 0:  # calls after the last compute op: that op's thread
        out[last] = out.get(last, []) + pending
    charges = {}
    tp_us = cost.host_tp_gemm_us * 1e-6
    for i, calls in out.items():
        roles = Counter(call_role(op) for op in calls)
        own = ops[i].tp_gemm
        charges[i] = Charge(sum(cost.host_time(op) for op in calls) + (tp_us if own else 0.0),
                            tuple(sorted(roles.items())),
                            sum(len(op.group) for op in calls if op.is_collective), own)
    return charges


def issue_cost(cost: CostModel) -> CostModel:
    """``cost`` with no host time for calls or DTensor dispatch: what the issue timeline
    (twin.sim.host) of a thread that pays them itself (thread_charges) charges."""
    return dataclasses.replace(cost, host_comm_us=0.0, host_comm_per_rank_us=0.0,
                               host_comm_by_group_us={}, host_tp_gemm_us=0.0)
