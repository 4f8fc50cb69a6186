"""The schedule's inventory of collectives and p2p calls vs the one PyTorch issued, per rank.

An inventory is keyed by (group, kind): the group is the tuple of global ranks (for a
send or recv, the sender and the receiver), and each key holds a count and the bytes
under the IR's convention (nccl-tests: all-reduce and broadcast the buffer, all-gather
the gathered output, reduce-scatter the full input; p2p the message). Counts and bytes
must agree. An all-to-all counts this rank's own send buffer (the IR's per-peer
``send_splits`` summed when sizes are uneven) and its per-member bytes sent and received
must agree too, call by call (``splits``). Order must agree for collectives, per group
(the n-th call on a group is the same call on every member); send/recv order is not
compared, since p2p ops do not
wait for each other (ir.py) and pipelining issues a step's sends and receives in its own
order. A difference that a documented rule explains (``RULES``) is reported as such;
the rest are the unexplained differences, which should be none.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from itertools import combinations

from twin.schedule.ir import Program
from twin.spec import Job

Key = tuple[tuple[int, ...], str]


@dataclass(frozen=True)
class Entry:
    """One call in an inventory: group, kind and bytes, in issue order."""

    group: tuple[int, ...]
    kind: str
    bytes: int
    splits: tuple = ()
    """An all-to-all's (bytes to, bytes from) each member; () for other kinds."""


def _a2a_splits(send, recv, nbytes: float, n: int) -> tuple:
    """(send, recv) bytes per member, equal parts of ``nbytes`` where none are listed."""
    even = (int(round(nbytes / n)),) * n
    return (tuple(int(round(b)) for b in send) or even,
            tuple(int(round(b)) for b in recv) or even)


@dataclass
class Difference:
    """One (rank, group, kind) whose count, bytes or order differ between IR and PyTorch."""

    rank: int
    group: tuple[int, ...]
    group_name: str
    kind: str
    what: str
    """count, bytes, order or splits (an all-to-all's per-member bytes)."""
    ir_count: int
    ir_bytes: int
    torch_count: int
    torch_bytes: int
    rule: str = ""
    """The documented rule that explains it ('' when unexplained)."""
    note: str = ""


@dataclass(frozen=True)
class Rule:
    """A deliberate, documented difference between PyTorch and the schedule."""

    id: str
    text: str
    applies: Callable[[Difference, Job], bool]


RULES = [
    Rule("fsdp2-sp-norm-grads-in-backward",
         "FSDP2 with TP+SP all-reduces each norm weight's partial gradient over TP inside "
         "backward (its post-backward hook, before the reduce-scatter); the schedule issues "
         "the same all-reduces (sp_norm_grad_sync=per_tensor) at step end, so the TP group's "
         "call order differs while counts and bytes agree.",
         lambda d, job: d.what == "order" and d.group_name == "tp" and job.parallel.sp
         and job.parallel.zero_stage == 3 and job.parallel.tp > 1),
]


def ir_entries(program: Program) -> list[Entry]:
    """The collectives and p2p calls of one rank's program, in program order."""
    out = []
    for op in program.ops:
        if op.is_collective and op.kind == "all_to_all":  # this rank's own send buffer
            splits = _a2a_splits(op.send_splits, op.recv_splits, op.bytes, len(op.group))
            out.append(Entry(tuple(op.group), op.kind, sum(splits[0]), splits))
        elif op.is_collective:
            out.append(Entry(tuple(op.group), op.kind, int(round(op.bytes))))
        elif op.is_p2p:
            out.append(Entry(tuple(sorted((program.rank, op.peer))), op.kind, int(round(op.bytes))))
    return out


def torch_entries(calls: list[dict], step: int, rank: int) -> list[Entry]:
    """The calls ``rank`` recorded in ``step``, in issue order."""
    out = []
    for c in calls:
        if c["step"] != step:
            continue
        group = tuple(sorted((rank, c["peer"]))) if c["kind"] in ("send", "recv") \
            else tuple(c["group"])
        splits = _a2a_splits(c.get("send_splits", ()), c.get("recv_splits", ()), c["bytes"],
                             len(group)) if c["kind"] == "all_to_all" else ()
        out.append(Entry(group, c["kind"], int(c["bytes"]), splits))
    return out


def table(entries: list[Entry]) -> dict[Key, tuple[int, int]]:
    """(group, kind) -> (count, bytes)."""
    out: dict[Key, list[int]] = {}
    for e in entries:
        c = out.setdefault((e.group, e.kind), [0, 0])
        c[0] += 1
        c[1] += e.bytes
    return {k: (v[0], v[1]) for k, v in sorted(out.items())}


def group_name(job: Job, rank: int, group: tuple[int, ...], kind: str) -> str:
    """The grid's name of a group ('tp', 'dp', 'tp-pp', ...); 'pp' for a send/recv pair."""
    grid = job.grid
    if kind in ("send", "recv"):  # a pipeline neighbour, or the CP ring's
        return "cp" if grid.size("cp") > 1 and set(group) <= set(grid.group(rank, "cp")) else "pp"
    dims = [d for d in ("tp", "pp", "dp", "cp") if grid.size(d) > 1]  # (dp-cp as the IR names it)
    if job.parallel.dp_replicate > 1:
        dims += ["dp_shard", "dp_replicate"]
    for n in range(1, len(dims) + 1):
        for combo in combinations(dims, n):
            if sum(d.startswith("dp") for d in combo) > 1:
                continue  # dp and its HSDP parts nest: at most one of them
            if tuple(sorted(grid.group(rank, combo))) == tuple(sorted(group)):
                return "-".join(combo)
    if job.model.moe is not None:  # the expert groups (twin/spec/experts.py)
        from twin.spec.experts import expert_grid

        experts = expert_grid(grid, job.parallel)
        for d in ("ep", "edp", "etp"):
            if tuple(sorted(experts.group(rank, d))) == tuple(sorted(group)):
                return d
    return "?"


def compare(job: Job, rank: int, ir: list[Entry], got: list[Entry]) -> list[Difference]:
    """Every count, bytes and order difference of one rank, each with its rule if documented."""
    a, b = table(ir), table(got)
    diffs = []
    for key in sorted(set(a) | set(b)):
        (ic, ib), (tc, tb) = a.get(key, (0, 0)), b.get(key, (0, 0))
        what = "count" if ic != tc else "bytes" if ib != tb else ""
        if not what and key[1] not in ("send", "recv"):
            if [e.bytes for e in ir if e.group == key[0] and e.kind == key[1]] != \
                    [e.bytes for e in got if e.group == key[0] and e.kind == key[1]]:
                what = "order"
            elif [e.splits for e in ir if e.group == key[0] and e.kind == key[1]] != \
                    [e.splits for e in got if e.group == key[0] and e.kind == key[1]]:
                what = "splits"
        if what:
            diffs.append(Difference(rank, key[0], group_name(job, rank, key[0], key[1]), key[1],
                                    what, ic, ib, tc, tb))
    groups = {k[0] for k in set(a) | set(b) if k[1] not in ("send", "recv")}
    for g in sorted(groups):  # interleaving of kinds on one group
        seq_ir = [(e.kind, e.bytes) for e in ir if e.group == g and e.kind not in ("send", "recv")]
        seq_pt = [(e.kind, e.bytes) for e in got if e.group == g and e.kind not in ("send", "recv")]
        if seq_ir != seq_pt and sorted(seq_ir) == sorted(seq_pt) and \
                not any(d.group == g for d in diffs):
            first = next(i for i, (x, y) in enumerate(zip(seq_ir, seq_pt)) if x != y)
            diffs.append(Difference(rank, g, group_name(job, rank, g, ""), "*", "order",
                                    len(seq_ir), sum(x[1] for x in seq_ir), len(seq_pt),
                                    sum(x[1] for x in seq_pt),
                                    note=f"first differs at call {first}: IR {seq_ir[first]}, "
                                         f"PyTorch {seq_pt[first]}"))
    for d in diffs:
        rule = next((r for r in RULES if r.applies(d, job)), None)
        if rule:
            d.rule = rule.id
    return diffs


def to_dict(d: Difference) -> dict:
    out = asdict(d)
    out["group"] = list(d.group)
    return out
