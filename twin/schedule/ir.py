"""The schedule IR: per-rank programs of ops, shared by the twin and the executor.

A ``Program`` is one rank's ordered list of ``Op``s. Program order is a valid
sequential execution (every dependency points backwards) and the issue order of
every stream. Stream semantics, the contract both the twin and the executor keep:

- ``compute`` and every ``comm*`` stream are FIFO: an op starts when the previous op
  on its stream has finished and its ``deps`` are done;
- ``p2p`` ops (send/recv, like isend/irecv) and ``mem`` ops (alloc/free) do not wait
  for each other: each starts as soon as its ``deps`` are done; memory ops take no time;
- a collective completes only when every rank of ``group`` has started it; the n-th
  collective with a given ``name`` on a group is the same call on every member;
- a send and a recv pair by (sender, receiver, tag).

An op's ``name`` is unique within its program and is the stable id shared by the
twin's and the executor's traces: a span is identified by (rank, name). A micro-batch token
(``mb`` and its number) in a name or tag names the micro-batch whose work the op is or whose
buffer it uses (a gathered unit kept from a later forward: ``bwd/mb6/L3/free.gathered.3.fwd.mb11``);
the same op d micro-batches later names each of them d later (twin/sim/fastforward.py). A
buffer that lives the whole step is named by no micro-batch.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from twin.files import write_text_atomic
from twin.vocab import (  # noqa: F401 - the IR's kinds, re-exported
    COLLECTIVE_KINDS,
    COMPUTE_KINDS,
    KINDS,
    MEMORY_CATEGORIES,
    MEMORY_KINDS,
    P2P_KINDS,
    PHASES,
)

FORMAT_VERSION = 1


@dataclass(frozen=True, slots=True)
class Op:
    """One op of a rank's program.

    ``shape`` by kind: gemm (m, n, k); attention (batch, heads, kv_heads, seq, head_dim,
    causal); elementwise (elements,), or (elements, 1) for one kernel in eager PyTorch too
    (``one_kernel``), or (elements, 0, 1) for a reduction along rows (``reduction``: norms,
    the loss), a fourth entry 1 outside the transformer blocks (``outside_blocks``);
    optimizer (params, fused). ``bytes``: memory traffic of a
    compute op, the nccl-tests size of a collective (all-reduce and broadcast the buffer,
    all-gather the gathered output, reduce-scatter the full input, all-to-all the send
    buffer), the message of a send/recv, the buffer of an alloc/free.
    """

    name: str
    kind: str
    stream: str
    deps: tuple[int, ...] = ()
    phase: str = "fwd"
    paradigm: str = ""
    layer: int = -1
    mb: int = -1
    chunk: int = -1
    shape: tuple[int, ...] = ()
    dtype: str = ""
    flops: float = 0.0
    bytes: float = 0.0
    group: tuple[int, ...] = ()
    group_name: str = ""
    root: int = -1
    peer: int = -1
    tag: str = ""
    category: str = ""
    send_splits: tuple[float, ...] = ()
    """An uneven all-to-all (MoE token dispatch): bytes sent to each member of ``group``, in
    group order, itself included (``bytes``: the members' mean send buffer, the same on
    every member); empty: bytes / n to each."""
    recv_splits: tuple[float, ...] = ()
    """An uneven all-to-all: bytes received from each member of ``group``, in group order."""

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def one_kernel(self) -> bool:
        """An elementwise op that eager PyTorch runs as one kernel, as modelled (FSDP2's
        copies): a profile's eager factor (CostModel.eager_elementwise) does not apply."""
        return self.kind == "elementwise" and len(self.shape) > 1 and bool(self.shape[1])

    @property
    def reduction(self) -> bool:
        """An elementwise op that reduces along its rows (a norm, the loss: ``shape``
        (elements, 0, 1)), priced as a reduction under torch.compile
        (CostModel.compiled_reduction_efficiency)."""
        return self.kind == "elementwise" and len(self.shape) > 2 and bool(self.shape[2])

    @property
    def outside_blocks(self) -> bool:
        """An elementwise op outside the transformer blocks (the embedding, final norm and
        loss, the step end's gradient clipping: ``shape`` (elements, 0, reduction, 1)), which
        torch.compile of each block (torchtitan's apply_compile) leaves eager."""
        return self.kind == "elementwise" and len(self.shape) > 3 and bool(self.shape[3])

    @property
    def tp_gemm(self) -> bool:
        """A GEMM of a tensor-parallel linear (paradigm tp or sp: TensorParallel's), whose
        weight PyTorch's TP holds as a DTensor (CostModel.host_tp_gemm_us)."""
        return self.kind == "gemm" and self.paradigm in ("tp", "sp")

    @property
    def is_collective(self) -> bool:
        return self.kind in COLLECTIVE_KINDS

    @property
    def is_p2p(self) -> bool:
        return self.kind in P2P_KINDS

    @property
    def is_memory(self) -> bool:
        return self.kind in MEMORY_KINDS


_TUPLE_FIELDS = {f.name for f in fields(Op) if f.type.startswith("tuple")}
_DEFAULTS = {f.name: f.default for f in fields(Op)}


def op_to_dict(op: Op) -> dict:
    """The op's non-default fields (compact JSON)."""
    return {k: (list(v) if k in _TUPLE_FIELDS else v) for k, v in asdict(op).items()
            if k in ("name", "kind", "stream") or v != _DEFAULTS[k]}


def op_from_dict(d: dict) -> Op:
    """Inverse of ``op_to_dict``."""
    unknown = set(d) - set(_DEFAULTS)
    if unknown:
        raise ValueError(f"op {d.get('name')!r} has unknown fields {sorted(unknown)}")
    return Op(**{k: (tuple(v) if k in _TUPLE_FIELDS else v) for k, v in d.items()})


@dataclass
class Program:
    """One rank's ops in issue order."""

    rank: int
    ops: list[Op] = field(default_factory=list)
    template: int | None = None
    """The rank whose program this one translates (same ops, streams and deps), if any."""
    blocks: list | None = None
    """The bodies and actions stamped from a recorded template (twin.schedule.stamp,
    twin.schedule.actions): (template, phase, layer, chunk, micro-batch, first op) each, its
    ``template.size`` ops consecutive, their fields but the names' micro-batches alike in every
    copy (an action's layer -1; the bodies inside a stamped action are not listed apart)."""
    codes: object = field(default=None, repr=False, compare=False)
    """Its ops' signature codes (twin.sim.codes.op_codes), made on first use."""

    def __iter__(self) -> Iterator[Op]:
        return iter(self.ops)

    def __len__(self) -> int:
        return len(self.ops)

    def index(self) -> dict[str, int]:
        """name -> position."""
        return {op.name: i for i, op in enumerate(self.ops)}

    def summary(self) -> dict:
        """Ops by kind and collectives by (group, kind): counts and bytes."""
        by_kind = Counter(op.kind for op in self.ops)
        coll: dict[tuple[str, str], list] = {}
        for op in self.ops:
            if op.is_collective or op.is_p2p:
                c = coll.setdefault((op.group_name or "p2p", op.kind), [0, 0.0])
                c[0] += 1
                c[1] += op.bytes
        return {
            "rank": self.rank,
            "ops": len(self.ops),
            "by_kind": dict(sorted(by_kind.items())),
            "flops": sum(op.flops for op in self.ops if op.is_compute),
            "collectives": [{"group": g, "kind": k, "count": n, "bytes": b}
                            for (g, k), (n, b) in sorted(coll.items())],
        }


class Schedule:
    """Per-rank programs of one job, built on demand (never all ranks unless asked)."""

    def __init__(self, job, builder: Callable[[object, int], Program] | None = None,
                 programs: dict[int, Program] | None = None):
        self.job = job
        self._builder = builder
        self._programs: dict[int, Program] = dict(programs or {})

    @property
    def world_size(self) -> int:
        return self.job.grid.world_size

    def program(self, rank: int) -> Program:
        """Rank's program (built and cached on first use)."""
        if rank not in self._programs:
            if self._builder is None:
                raise KeyError(f"rank {rank} is not in this loaded schedule")
            if not 0 <= rank < self.world_size:
                raise ValueError(f"rank {rank} out of range 0..{self.world_size - 1}")
            self._programs[rank] = self._builder(self.job, rank)
        return self._programs[rank]

    def programs(self, ranks=None) -> dict[int, Program]:
        """Programs of ``ranks`` (default: every rank of the job)."""
        return {r: self.program(r) for r in (range(self.world_size) if ranks is None else ranks)}

    def to_dict(self, ranks=None) -> dict:
        from twin.spec.io import job_to_dict

        return {"format": "paratwin-schedule", "version": FORMAT_VERSION,
                "job": job_to_dict(self.job),
                "programs": {str(r): [op_to_dict(o) for o in p.ops]
                             for r, p in self.programs(ranks).items()}}

    def save(self, path: str | Path, ranks=None) -> None:
        """Write the programs of ``ranks`` (default all) as JSON, atomically."""
        write_text_atomic(path, json.dumps(self.to_dict(ranks)))

    @classmethod
    def from_dict(cls, data: dict) -> Schedule:
        from twin.spec.io import job_from_dict

        if not isinstance(data, dict) or data.get("format") != "paratwin-schedule":
            raise ValueError("not a paratwin schedule (missing format: paratwin-schedule)")
        if data.get("version") != FORMAT_VERSION:
            raise ValueError(f"schedule format version {data.get('version')} is not supported "
                             f"(this paratwin reads version {FORMAT_VERSION})")
        programs = {int(r): Program(int(r), [op_from_dict(o) for o in ops])
                    for r, ops in data["programs"].items()}
        return cls(job_from_dict(data["job"]), builder=None, programs=programs)

    @classmethod
    def load(cls, path: str | Path) -> Schedule:
        """Read a schedule written by ``save``; a file that is not one says so."""
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not a paratwin schedule (not JSON: {err})") from None
        return cls.from_dict(data)
