"""Record every collective and point-to-point call a process issues, at the c10d dispatcher.

How: every ProcessGroup call, whoever makes it, is one of the ``c10d::*`` dispatcher ops
(``c10d::allreduce_``, ``c10d::_allgather_base_``, ``c10d::send`` ...): Python's
``dist.all_reduce``, DDP's C++ Reducer, the functional collectives that DTensor and FSDP2
use, and pipelining's ``batch_isend_irecv`` all arrive there. ``Recorder.install``
registers a pass-through kernel for each of them on the BackendSelect dispatch key,
which every call passes (it is in the default included set and, unlike the autograd
keys, is not skipped by calls made from inside other kernels); the kernel writes one
``Call`` (kind, group's global ranks, bytes, peer, step and phase labels) and
redispatches to the real backend kernel below it, untouched.

Why not the alternatives: wrapping the Python ``torch.distributed`` functions misses
the Reducer and the functional collectives, which call the ProcessGroup from C++; the
profiler's ``record_param_comms`` metadata is emitted by NCCL but not by gloo (torch
2.13), and the flight recorder on gloo logs collectives but not send/recv.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass

import torch

# c10d op -> (IR kind, which arguments count under the nccl-tests convention)
OPS = {
    "allreduce_": ("all_reduce", "in"),
    "allreduce_coalesced_": ("all_reduce", "in"),
    "allgather_": ("all_gather", "out"),
    "_allgather_base_": ("all_gather", "out"),
    "allgather_coalesced_": ("all_gather", "out"),
    "allgather_into_tensor_coalesced_": ("all_gather", "out"),
    "reduce_scatter_": ("reduce_scatter", "in"),
    "_reduce_scatter_base_": ("reduce_scatter", "in"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "in"),
    "broadcast_": ("broadcast", "in"),
    "reduce_": ("reduce", "in"),
    "gather_": ("gather", "out"),
    "scatter_": ("scatter", "in"),
    "alltoall_": ("all_to_all", "in"),
    "alltoall_base_": ("all_to_all", "in"),
    "send": ("send", "in"),
    "recv_": ("recv", "in"),
    "recv_any_source_": ("recv", "in"),
    "barrier": ("barrier", "none"),
    "monitored_barrier_": ("barrier", "none"),
}
# schema position of (output, input) tensors for ops whose first argument is the output
_OUT_FIRST = {"allgather_", "_allgather_base_", "allgather_coalesced_",
              "allgather_into_tensor_coalesced_", "reduce_scatter_", "_reduce_scatter_base_",
              "reduce_scatter_tensor_coalesced_", "gather_", "scatter_", "alltoall_", "alltoall_base_"}


@dataclass(frozen=True)
class Call:
    """One collective or p2p call as issued by this rank."""

    seq: int
    step: int
    phase: str
    kind: str
    op: str
    """The c10d op (e.g. _allgather_base_), for the record."""
    group: tuple[int, ...]
    """Global ranks of the process group, ascending."""
    bytes: int
    peer: int = -1
    """Global rank of the other side of a send/recv."""
    tensors: int = 1
    """Tensors the call moved (coalesced calls move several)."""
    send_splits: tuple[int, ...] = ()
    """An all-to-all's bytes to each member (group order); () for other kinds."""
    recv_splits: tuple[int, ...] = ()
    """An all-to-all's bytes from each member."""


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


def _nbytes(ts: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _splits(t: torch.Tensor, rows: list[int], n: int) -> tuple[int, ...]:
    """Per-member bytes of an all_to_all_single buffer: its split sizes (rows of dim 0), or n
    equal parts when none were given."""
    total = _nbytes([t])
    if not rows:
        return (total // n,) * n
    row = total // max(1, t.shape[0]) if t.dim() else total
    return tuple(int(r) * row for r in rows)


def a2a_splits(name: str, args: tuple, n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(send, recv) bytes per member of an all-to-all call; ((), ()) for other ops."""
    if name == "alltoall_base_":  # (output, input, pg, output_split_sizes, input_split_sizes)
        return _splits(args[1], list(args[4]), n), _splits(args[0], list(args[3]), n)
    if name == "alltoall_":  # (output_tensors, input_tensors, pg): one tensor per member
        return tuple(_nbytes([t]) for t in args[1]), tuple(_nbytes([t]) for t in args[0])
    return (), ()


class Recorder:
    """Collects ``Call``s while ``active``; ``step`` and ``phase`` label what follows."""

    def __init__(self, rank: int):
        self.rank = rank
        self.calls: list[Call] = []
        self.active = False
        self.step, self.phase = -1, ""
        self._lib = None
        self._lock = threading.Lock()
        self._ranks: dict[str, tuple[int, ...]] = {}

    def group_ranks(self, pg) -> tuple[int, ...]:
        """Global ranks of a process group, from c10d's own registry (by group name)."""
        import torch.distributed.distributed_c10d as c10d

        name = pg.group_name
        if name not in self._ranks:
            for g, n in c10d._world.pg_names.items():
                self._ranks[n] = tuple(sorted(c10d._world.pg_group_ranks[g]))
        if name not in self._ranks:
            raise RuntimeError(f"process group {name!r} is not in c10d's registry; create groups "
                               "with dist.new_group or a DeviceMesh")
        return self._ranks[name]

    def record(self, name: str, args: tuple) -> None:
        from torch._C._distributed_c10d import ProcessGroup

        if not self.active:
            return
        kind, side = OPS[name]
        pg = next(ProcessGroup.unbox(a) for a in args if isinstance(a, torch.ScriptObject)
                  and "ProcessGroup" in str(a._type()))
        group = self.group_ranks(pg)
        if name in _OUT_FIRST:
            out, inp = _tensors(args[0]), _tensors(args[1])
        else:
            out = inp = _tensors(args[0])
        counted = {"out": out, "in": inp, "none": []}[side]
        peer = -1
        if kind in ("send", "recv") and name != "recv_any_source_":
            peer = group[int(args[2])]
        send, recv = a2a_splits(name, args, len(group))
        with self._lock:
            self.calls.append(Call(len(self.calls), self.step, self.phase, kind, name, group,
                                   _nbytes(counted), peer, max(1, len(counted)), send, recv))

    def install(self) -> Recorder:
        """Register the pass-through kernels (once per process)."""
        if self._lib is not None:
            return self
        import torch.distributed  # noqa: F401 - registers the c10d ops

        self._lib = torch.library.Library("c10d", "IMPL")
        for name in OPS:
            if hasattr(torch.ops.c10d, name):
                self._lib.impl(name, self._kernel(name), "BackendSelect", with_keyset=True)
        return self

    def _kernel(self, name: str):
        op = getattr(torch.ops.c10d, name).default
        backend_select = torch._C.DispatchKey.BackendSelect

        def kernel(keyset, *args, **kwargs):
            self.record(name, args)
            return op.redispatch(keyset.remove(backend_select), *args, **kwargs)

        return kernel

    def label(self, step: int, phase: str) -> None:
        self.step, self.phase = step, phase

    def to_dicts(self) -> list[dict]:
        return [asdict(c) for c in self.calls]
