"""Process groups of a schedule: a communicator per (stream, group) of its collectives and per p2p direction.

The groups come from the schedule's ops (whose ``group`` the planner took from
``RankGrid``, the one place groups are computed); nothing here recomputes them.

Why per (stream, group): the IR's comm streams are FIFO, and NCCL runs the ops of one
communicator in issue order on one CUDA stream, so a communicator per (stream, group)
gives each stream its own FIFO lane and lets different streams overlap (FSDP's
parameter all-gathers on ``comm.ag`` beside its gradient reduce-scatters on ``comm``).
On CPU each is a gloo backend with a single worker thread (gloo's default of two would
run two ops of a stream at once), built directly over a prefix of the store, so only
members take part; every rank builds its groups in one global sorted order, which cannot
deadlock. On GPU ``dist.new_group`` is called by every rank for every group, in the same
order, as torch requires for NCCL.

Sends and receives get a communicator per direction (sender, receiver): NCCL runs the p2p
ops of one communicator in order on one stream, so with one communicator per pair a
pipeline stage's send would wait behind its own pending recv while the neighbour's does
the same (1F1B's steady state); one per direction keeps the IR's unordered p2p.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist

from twin.schedule.ir import Op, Program

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Backend  # gloo's or NCCL's, as ops are issued on

Key = tuple[str, tuple[int, ...]]
"""A collective communicator: (stream, group's ranks)."""
Pair = tuple[int, int]
"""A p2p communicator: (sender, receiver)."""


class CommSpec(NamedTuple):
    """One communicator to build, in the global order every rank follows."""

    name: str
    """Its store prefix, e.g. 'comm/0-1-2-3' or 'p2p/0->4'."""
    members: tuple[int, ...]
    """Its ranks in rank order (a group index is a position here)."""
    key: Key | Pair
    """Where it goes in Comms: ``collective[key]``, or ``p2p[key]`` when ``is_p2p``."""
    is_p2p: bool


def comm_keys(programs: dict[int, Program]) -> list[Key]:
    """Sorted (stream, group) of every collective in ``programs``."""
    return sorted({(op.stream, tuple(op.group)) for p in programs.values() for op in p.ops
                   if op.is_collective})


def p2p_pairs(programs: dict[int, Program]) -> list[Pair]:
    """Sorted (sender, receiver) of every send and recv in ``programs``."""
    pairs = set()
    for r, p in programs.items():
        for op in p.ops:
            if op.kind == "send":
                pairs.add((r, op.peer))
            elif op.kind == "recv":
                pairs.add((op.peer, r))
    return sorted(pairs)


def gloo_device(loopback: bool):
    """The gloo transport device: loopback only for local runs; else GLOO_SOCKET_IFNAME's
    interfaces, else the address of this host's name."""
    G = dist.ProcessGroupGloo
    if loopback:
        return [G.create_device(hostname="127.0.0.1")]
    ifnames = [i for i in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if i]
    if ifnames:
        return [G.create_device(interface=i) for i in ifnames]
    return [G.create_default_device()]


@dataclass
class Comms:
    """The communicators one rank takes part in: ``collective[(stream, group)]`` and
    ``p2p[(sender, receiver)]`` (two members, in rank order)."""

    rank: int
    collective: dict[Key, Backend] = field(default_factory=dict)
    p2p: dict[Pair, Backend] = field(default_factory=dict)
    backend: str = "gloo"

    def for_op(self, op: Op) -> Backend:
        """The backend an op runs on (KeyError names the op if its group was not built)."""
        if op.is_p2p:
            pair = (self.rank, op.peer) if op.kind == "send" else (op.peer, self.rank)
            try:
                return self.p2p[pair]
            except KeyError:
                raise KeyError(f"rank {self.rank}: {op.name} needs a p2p communicator "
                               f"{pair[0]}->{pair[1]}, which was not built") from None
        key = (op.stream, tuple(op.group))
        try:
            return self.collective[key]
        except KeyError:
            raise KeyError(f"rank {self.rank}: {op.name} needs a communicator for stream "
                           f"{op.stream} over ranks {op.group}, which was not built") from None


def _gloo(store: dist.Store, name: str, group: tuple[int, ...], rank: int,
          timeout: datetime.timedelta, loopback: bool) -> dist.ProcessGroupGloo:
    opts = dist.ProcessGroupGloo._Options()
    opts._threads = 1
    opts._timeout = timeout
    opts._devices = gloo_device(loopback)
    prefix = dist.PrefixStore(f"paratwin/{name}", store)
    return dist.ProcessGroupGloo(prefix, group.index(rank), len(group), opts)


def build_comms(programs: dict[int, Program], rank: int, world_size: int, store: dist.Store,
                backend: str, timeout_s: float, loopback: bool = False,
                prefix: str = "replay") -> Comms:
    """Build this rank's communicators; every rank must call this with the same programs
    (and a ``prefix`` not used before in this store, when building several sets)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    comms = Comms(rank=rank, backend=backend)
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend {backend!r} is not gloo or nccl")
    wanted = [CommSpec(f"{stream}/{'-'.join(map(str, group))}", group, (stream, group), False)
              for stream, group in comm_keys(programs)]
    wanted += [CommSpec(f"p2p/{a}->{b}", tuple(sorted((a, b))), (a, b), True)
               for a, b in p2p_pairs(programs)]
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
    for spec in wanted:
        group = spec.members
        if backend == "gloo":
            pg = _gloo(store, f"{prefix}/{spec.name}", group, rank, timeout, loopback) \
                if rank in group else None
        else:
            new = dist.new_group(list(group), timeout=timeout, backend="nccl")
            pg = new._get_backend(device) if rank in group else None
        if pg is not None:
            (comms.p2p if spec.is_p2p else comms.collective)[spec.key] = pg
            if backend == "nccl":
                # NCCL creates a communicator at its first op, blocking until every member
                # gets there: touch each now, in the global order, so that the schedule's own
                # first-use order (which differs between ranks) cannot deadlock
                pg.allreduce([torch.zeros(1, device=device)]).wait()
    if backend == "nccl":
        torch.cuda.synchronize(device)
    return comms
