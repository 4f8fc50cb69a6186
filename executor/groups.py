"""Process groups of a schedule: one communicator per (stream, group) of its collectives, one for p2p.

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
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from twin.schedule.ir import Program

Key = tuple[str, tuple[int, ...]]


def comm_keys(programs: dict[int, Program]) -> list[Key]:
    """Sorted (stream, group) of every collective in ``programs``."""
    return sorted({(op.stream, tuple(op.group)) for p in programs.values() for op in p.ops
                   if op.is_collective})


def has_p2p(programs: dict[int, Program]) -> bool:
    return any(op.is_p2p for p in programs.values() for op in p.ops)


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
    """The communicators one rank takes part in: ``collective[key]`` and ``p2p``."""

    rank: int
    collective: dict[Key, object] = field(default_factory=dict)
    p2p: object | None = None
    backend: str = "gloo"

    def for_op(self, op) -> object:
        """The backend an op runs on (KeyError names the op if its group was not built)."""
        if op.is_p2p:
            if self.p2p is None:
                raise KeyError(f"{op.name}: no p2p communicator was built")
            return self.p2p
        key = (op.stream, tuple(op.group))
        try:
            return self.collective[key]
        except KeyError:
            raise KeyError(f"rank {self.rank}: {op.name} needs a communicator for stream "
                           f"{op.stream} over ranks {op.group}, which was not built") from None


def _gloo(store, name: str, group: tuple[int, ...], rank: int, timeout: datetime.timedelta,
          loopback: bool):
    opts = dist.ProcessGroupGloo._Options()
    opts._threads = 1
    opts._timeout = timeout
    opts._devices = gloo_device(loopback)
    prefix = dist.PrefixStore(f"paratwin/{name}", store)
    return dist.ProcessGroupGloo(prefix, group.index(rank), len(group), opts)


def build_comms(programs: dict[int, Program], rank: int, world_size: int, store, backend: str,
                timeout_s: float, loopback: bool = False) -> Comms:
    """Build this rank's communicators; every rank must call this with the same programs."""
    timeout = datetime.timedelta(seconds=timeout_s)
    comms = Comms(rank=rank, backend=backend)
    keys = comm_keys(programs)
    world = tuple(range(world_size))
    p2p = has_p2p(programs) and world_size > 1
    if backend == "gloo":
        for stream, group in keys:
            if rank in group:
                name = f"{stream}/{'-'.join(map(str, group))}"
                comms.collective[(stream, group)] = _gloo(store, name, group, rank, timeout,
                                                          loopback)
        if p2p:
            comms.p2p = _gloo(store, "p2p", world, rank, timeout, loopback)
        return comms
    if backend != "nccl":
        raise ValueError(f"backend {backend!r} is not gloo or nccl")
    device = torch.device("cuda", torch.cuda.current_device())
    for stream, group in keys:
        pg = dist.new_group(list(group), timeout=timeout, backend="nccl")
        if rank in group:
            comms.collective[(stream, group)] = pg._get_backend(device)
    if p2p:
        comms.p2p = dist.new_group(list(world), timeout=timeout, backend="nccl")._get_backend(device)
    return comms
