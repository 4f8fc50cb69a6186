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

from twin.cost import CostModel
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
    for op in ops:  # the same kinds and shapes recur at every layer and micro-batch
        key = (op.kind, op.dtype, len(op.group), op.shape, op.bytes, op.flops)
        h = memo.get(key)
        if h is None:
            h = memo[key] = cost.host_time(op)
        host.append(h)
    # the sends and recvs of the pipeline's exchange (group pp, or unnamed as in schedules
    # written before send/recv had other groups), where Megatron's host waits
    pipe = [op.kind in P2P_KINDS and op.group_name in ("pp", "") for op in ops]
    sync = cost.p2p_host_sync and any(pipe)
    if not sync and not any(host):
        return None
    issue = list(itertools.accumulate(host))
    sync_of = [-1] * len(ops)  # memory ops keep -1: no time, no host
    waits: dict[int, tuple[int, ...]] = {}
    last_of_stream: dict[str, int] = {}
    current = -1
    timed = [i for i, op in enumerate(ops) if op.stream != "mem"]
    last = len(timed) - 1
    for k, i in enumerate(timed):
        sync_of[i] = current
        op = ops[i]
        last_of_stream[op.stream if op.kind not in P2P_KINDS else f"p2p{i}"] = i
        if sync and pipe[i] and (k == last or not pipe[timed[k + 1]]):  # a batch ends
            waits[i] = tuple(sorted(set(last_of_stream.values())))
            last_of_stream = {s: j for s, j in last_of_stream.items() if not s.startswith("p2p")}
            current = i
    return HostPlan(issue, sync_of, waits)

