"""The rank's host thread: it issues ops in program order, and sometimes waits for the device.

Eager PyTorch spends CPU time on every op (dispatch, autograd, kernel launches) before the
device can run it: op i is issued at H_i, the host's costs summed in program order, and
cannot start earlier (``CostModel.host_time``). When the host synchronizes with the device
it stops issuing until the device has finished what it was given: Megatron's pipeline
exchange calls ``batch_isend_irecv``, waits on the requests and then
``torch.cuda.synchronize()`` ("to protect against race condition"), so with
``CostModel.p2p_host_sync`` every run of consecutive pipeline send/recv ops is a sync point
(async TP's TP-ring transfers run on copy engines and hold nothing back). An op
j after sync point s is issued at max(H_j, T_s + H_j - H_s), T_s being when the last op
issued before the sync (on every stream, the batch included) has finished.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from twin.cost import CostModel, host_key
from twin.schedule.ir import Op
from twin.vocab import P2P_KINDS


@dataclass(frozen=True)
class HostPlan:
    """When each op of one program is issued, and which sync point holds it back."""

    issue_s: list[float]
    """H_i: the host's costs summed in program order, op i's included."""
    sync_of: list[int]
    """Per op: the last sync point before it (the index of the batch's last op), -1: none."""
    waits: dict[int, tuple[int, ...]]
    """Sync point -> the ops the host waits for there (the last op of each stream up to it)."""

    def offset_s(self, i: int) -> float:
        """H_i - H_s: the host's time from its sync point to issuing op i."""
        s = self.sync_of[i]
        return self.issue_s[i] - self.issue_s[s] if s >= 0 else self.issue_s[i]


def host_plan(ops: list[Op], cost: CostModel) -> HostPlan | None:
    """The host's plan of a program, or None when the host neither costs nor waits."""
    memo: dict[tuple, float] = {}
    host = []
    for op in ops:  # the same kinds and groups recur at every layer and micro-batch
        key = host_key(op)
        h = memo.get(key)
        if h is None:
            h = memo[key] = cost.host_time(op)
        host.append(h)
    sync_of = [-1] * len(ops)  # memory ops keep -1: no time, no host
    waits: dict[int, tuple[int, ...]] = {}
    if cost.p2p_host_sync:
        _sync_points(ops, sync_of, waits)
    if not waits and not any(host):
        return None
    return HostPlan(list(itertools.accumulate(host)), sync_of, waits)


def _sync_points(ops: list[Op], sync_of: list[int], waits: dict[int, tuple[int, ...]]) -> None:
    """Fill in each timed op's sync point and what the host waits for at each: a sync point
    is the last op of a run of consecutive (timed) sends and recvs of the pipeline's exchange
    (group pp, or unnamed as in schedules written before send/recv had other groups)."""
    last_of_stream: dict[str, int] = {}  # each send/recv its own
    current = batch = -1  # the last sync point; the last op of the exchange being issued
    for i, op in enumerate(ops):
        if op.stream == "mem":
            continue
        p2p = op.kind in P2P_KINDS
        if batch >= 0 and not (p2p and op.group_name in ("pp", "")):  # the batch has ended
            waits[batch] = tuple(sorted(set(last_of_stream.values())))
            last_of_stream = {s: j for s, j in last_of_stream.items() if not s.startswith("p2p")}
            current, batch = batch, -1
        sync_of[i] = current
        if p2p:
            last_of_stream[f"p2p{i}"] = i
            if op.group_name in ("pp", ""):
                batch = i
        else:
            last_of_stream[op.stream] = i
    if batch >= 0:  # the program ends with one
        waits[batch] = tuple(sorted(set(last_of_stream.values())))
