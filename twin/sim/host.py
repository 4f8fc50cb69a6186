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

import numpy as np

from twin.cost import CostModel
from twin.schedule.ir import Op
from twin.sim.codes import Codes, codes_of
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


def host_plan(ops: list[Op], cost: CostModel, codes: Codes | None = None) -> HostPlan | None:
    """The host's plan of a program, or None when the host neither costs nor waits.
    ``codes``: its ops' signatures (default: made here); the host's time of an op is its
    signature's."""
    codes = codes_of(ops) if codes is None else codes
    host = codes.column([cost.host_time(op) for op in codes.reps], float).tolist()
    sync_of = [-1] * len(ops)  # memory ops keep -1: no time, no host
    waits: dict[int, tuple[int, ...]] = {}
    if cost.p2p_host_sync:
        sync_of = _sync_points(codes, waits)
    if not waits and not any(host):
        return None
    return HostPlan(list(itertools.accumulate(host)), sync_of, waits)


def _sync_points(codes: Codes, waits: dict[int, tuple[int, ...]]) -> list[int]:
    """Each op's sync point (returned; -1: none, and for memory ops) and what the host waits
    for at each (filled into ``waits``). A sync point is the last op of a run of consecutive
    timed sends and recvs of the pipeline's exchange (group pp, or unnamed as in schedules
    written before send/recv had other groups); a timed op's is the last one before it. The
    host waits there for the last op so far of each stream but the sends and recvs, and for
    every send and recv (any group) since the sync point before."""
    reps, code = codes.reps, codes.code
    p2p = np.array([op.kind in P2P_KINDS for op in reps], dtype=bool)
    pipe = p2p & np.array([op.group_name in ("pp", "") for op in reps], dtype=bool)
    mem = codes.column([op.stream == "mem" for op in reps], bool)
    timed = np.flatnonzero(~mem)
    run = pipe[code[timed]]
    ends = timed[run & ~np.append(run[1:], False)]  # the sync points
    if not len(ends):
        return [-1] * len(code)
    sync_of = np.full(len(code), -1, dtype=np.int64)
    k = np.searchsorted(ends, timed, side="left") - 1
    sync_of[timed] = np.where(k >= 0, ends[np.maximum(k, 0)], -1)
    before = np.concatenate([[-1], ends[:-1]])  # each sync point's previous one
    is_p2p = p2p[code] & ~mem
    lasts = []  # per stream: its last op up to each sync point (-1: none)
    for s, idx in codes.stream_arrays().items():
        idx = idx[~is_p2p[idx]]
        if not len(idx):
            continue
        at = np.searchsorted(idx, ends, side="right") - 1
        last = np.where(at >= 0, idx[np.maximum(at, 0)], -1)
        if s.startswith("p2p"):  # a stream named like the sends' own: forgotten at each sync
            last = np.where(last > before, last, -1)
        lasts.append(last)
    sends = np.flatnonzero(is_p2p)
    lo = np.searchsorted(sends, before, side="right").tolist()
    hi = np.searchsorted(sends, ends, side="right").tolist()
    table = np.stack(lasts, axis=1).tolist() if lasts else [[] for _ in lo]
    sends_l = sends.tolist()
    for j, e in enumerate(ends.tolist()):
        waits[e] = tuple(sorted({*(x for x in table[j] if x >= 0), *sends_l[lo[j]:hi[j]]}))
    return sync_of.tolist()
