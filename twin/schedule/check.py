"""Static checks of a schedule: deadlock freedom, collective order, p2p pairing, memory.

``walk`` executes all programs abstractly (every op takes no time) under the IR's
stream semantics (ir.py): FIFO streams, unordered p2p and memory ops, collectives that
complete when every member has reached them, sends that complete with their recv. If
the walk cannot finish, the schedule deadlocks, and the error names the stuck ops.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from twin.schedule.ir import Op, Program

UNORDERED = ("p2p", "mem")


class ScheduleError(AssertionError):
    """A schedule that cannot run: deadlock, mismatched collective, unpaired p2p."""


def check_collective_order(programs: dict[int, Program]) -> int:
    """Every member of every group issues the group's collectives in the same order with
    the same kind and bytes. Returns the number of collective calls checked."""
    seqs: dict[tuple[int, ...], dict[int, list[tuple[str, str, float]]]] = defaultdict(dict)
    for rank, prog in programs.items():
        for op in prog.ops:
            if op.is_collective:
                if rank not in op.group:
                    raise ScheduleError(f"rank {rank}: {op.name} runs on group {op.group} "
                                        "that does not contain the rank")
                seqs[op.group].setdefault(rank, []).append((op.name, op.kind, op.bytes))
    calls = 0
    for group, by_rank in seqs.items():
        members = [r for r in group if r in programs]
        if len(members) < len(group) and len(programs) > 1:
            continue  # partial schedule: cannot compare absent members
        ref = by_rank.get(members[0], [])
        for r in members[1:]:
            other = by_rank.get(r, [])
            if other != ref:
                i = next((k for k, (a, b) in enumerate(zip(ref, other)) if a != b),
                         min(len(ref), len(other)))
                raise ScheduleError(
                    f"group {group}: rank {members[0]} and rank {r} diverge at collective #{i}: "
                    f"{ref[i] if i < len(ref) else 'nothing'} vs "
                    f"{other[i] if i < len(other) else 'nothing'}")
        calls += len(ref)
    return calls


def check_p2p_pairs(programs: dict[int, Program]) -> int:
    """Every send has exactly one recv on its peer with the same tag and bytes."""
    sends, recvs = {}, {}
    for rank, prog in programs.items():
        for op in prog.ops:
            if op.kind == "send":
                key = (rank, op.peer, op.tag)
                if key in sends:
                    raise ScheduleError(f"rank {rank}: two sends to {op.peer} with tag {op.tag}")
                sends[key] = op.bytes
            elif op.kind == "recv":
                key = (op.peer, rank, op.tag)
                if key in recvs:
                    raise ScheduleError(f"rank {rank}: two recvs from {op.peer} with tag {op.tag}")
                recvs[key] = op.bytes
    for key, nbytes in sends.items():
        if key[1] in programs and recvs.get(key) != nbytes:
            raise ScheduleError(f"send {key[0]}->{key[1]} tag {key[2]} ({nbytes} B) has no "
                                f"matching recv (found {recvs.get(key)})")
    for key in recvs:
        if key[0] in programs and key not in sends:
            raise ScheduleError(f"recv {key[0]}->{key[1]} tag {key[2]} has no matching send")
    # NCCL pairs the sends and recvs of one direction in issue order, ignoring tags: the
    # order of tags must agree on both sides
    order_s: dict[tuple[int, int], list[str]] = {}
    order_r: dict[tuple[int, int], list[str]] = {}
    for rank, prog in programs.items():
        for op in prog.ops:
            if op.kind == "send":
                order_s.setdefault((rank, op.peer), []).append(op.tag)
            elif op.kind == "recv":
                order_r.setdefault((op.peer, rank), []).append(op.tag)
    for pair, tags in order_s.items():
        if pair[1] in programs and order_r.get(pair) != tags:
            other = order_r.get(pair, [])
            i = next((k for k, (a, b) in enumerate(zip(tags, other)) if a != b), min(len(tags), len(other)))
            raise ScheduleError(f"sends {pair[0]}->{pair[1]} and the matching recvs are issued in different "
                                f"orders (first at #{i}: {tags[i] if i < len(tags) else '-'} vs "
                                f"{other[i] if i < len(other) else '-'}); NCCL pairs them by order")
    return len(sends)


@dataclass
class WalkResult:
    ops: int
    rounds: int


def walk(programs: dict[int, Program]) -> WalkResult:
    """Run every program with zero-time ops; raise ScheduleError on deadlock."""
    done = {r: [False] * len(p.ops) for r, p in programs.items()}
    queues: dict[int, dict[str, list[int]]] = {}
    heads: dict[int, dict[str, int]] = {}
    loose: dict[int, list[int]] = {}
    for r, p in programs.items():
        for i, op in enumerate(p.ops):
            if any(d >= i for d in op.deps):
                raise ScheduleError(f"rank {r}: {op.name} depends on a later op")
        qs: dict[str, list[int]] = defaultdict(list)
        loose[r] = []
        for i, op in enumerate(p.ops):
            (loose[r] if op.stream in UNORDERED else qs[op.stream]).append(i)
        queues[r], heads[r] = dict(qs), {s: 0 for s in qs}
    arrived: dict[tuple, set[int]] = defaultdict(set)
    posted: dict[tuple, int] = {}
    remaining = sum(len(p.ops) for p in programs.values())
    rounds = 0
    progress = True
    while progress and remaining:
        progress = False
        rounds += 1
        for r, p in programs.items():
            ops, dn = p.ops, done[r]

            def ready(i: int, dn=dn, ops=ops) -> bool:
                return all(dn[d] for d in ops[i].deps)

            moved = True
            while moved:
                moved = False
                keep = []
                for i in loose[r]:
                    op = ops[i]
                    if not ready(i):
                        keep.append(i)
                    elif op.is_memory:
                        dn[i] = True
                        remaining -= 1
                        moved = progress = True
                    else:
                        key = (r, op.peer, op.tag) if op.kind == "send" else (op.peer, r, op.tag)
                        other = posted.get(key)
                        if other is None or other == (r, i):
                            posted[key] = (r, i)
                            keep.append(i)
                        else:
                            orank, oi = other
                            dn[i] = done[orank][oi] = True
                            remaining -= 2
                            moved = progress = True
                loose[r] = keep
                for s, q in queues[r].items():
                    while heads[r][s] < len(q) and ready(q[heads[r][s]]):
                        op: Op = ops[q[heads[r][s]]]
                        if not op.is_collective:
                            dn[q[heads[r][s]]] = True
                            remaining -= 1
                            heads[r][s] += 1
                            moved = progress = True
                            continue
                        key = (op.group, op.name)
                        arrived[key].add(r)
                        if len(arrived[key]) < len(op.group):
                            break
                        for m in op.group:  # every member's head on some stream is this op
                            mq = _find_head(queues[m], heads[m], programs[m].ops, op.name)
                            done[m][queues[m][mq][heads[m][mq]]] = True
                            heads[m][mq] += 1
                            remaining -= 1
                        del arrived[key]
                        moved = progress = True
    if remaining:
        stuck = []
        for r, p in programs.items():
            pend = [p.ops[q[heads[r][s]]].name for s, q in queues[r].items() if heads[r][s] < len(q)]
            pend += [p.ops[i].name for i in loose[r]][:2]
            if pend:
                stuck.append(f"rank {r} waits at {pend[:4]}")
        raise ScheduleError(f"deadlock: {remaining} ops cannot run; " + "; ".join(stuck[:6]))
    return WalkResult(ops=sum(len(p.ops) for p in programs.values()), rounds=rounds)


def _find_head(queues: dict[str, list[int]], heads: dict[str, int], ops: list[Op],
               name: str) -> str:
    for s, q in queues.items():
        if heads[s] < len(q) and ops[q[heads[s]]].name == name:
            return s
    raise ScheduleError(f"collective {name} completed on a rank that is not waiting in it")


def check_schedule(programs: dict[int, Program]) -> dict:
    """All static checks; returns counts."""
    calls = check_collective_order(programs)
    pairs = check_p2p_pairs(programs)
    res = walk(programs)
    return {"ranks": len(programs), "ops": res.ops, "collective_calls": calls,
            "p2p_pairs": pairs, "rounds": res.rounds}


def memory_peak(program: Program) -> tuple[float, dict[str, float]]:
    """Peak of live bytes walking the program in order, and the live bytes by category then.

    Raises if a buffer is freed that was not allocated (or twice)."""
    live: dict[str, float] = {}
    cats: dict[str, str] = {}
    total = peak = 0.0
    at_peak: dict[str, float] = {}
    for op in program.ops:
        if op.kind == "alloc":
            if op.tag in live:
                raise ScheduleError(f"rank {program.rank}: buffer {op.tag} allocated twice")
            live[op.tag], cats[op.tag] = op.bytes, op.category
            total += op.bytes
            if total > peak:
                peak = total
                at_peak = defaultdict(float)
                for t, nbytes in live.items():
                    at_peak[cats[t]] += nbytes
        elif op.kind == "free":
            if op.tag not in live:
                raise ScheduleError(f"rank {program.rank}: buffer {op.tag} freed but not live")
            total -= live.pop(op.tag)
    return peak, dict(at_peak)
