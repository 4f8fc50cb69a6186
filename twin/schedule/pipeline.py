"""Pipeline schedules as pure tables: the (phase, micro-batch, chunk) order of each stage.

An action is (phase, micro-batch, chunk) with phase F (forward), B (the whole backward),
I (its input-gradient half) or W (its weight-gradient half; B = I + W). Which stage holds
model chunk c is ``chunk_stage``: c % p (Megatron's loop) or the V of ZB-V and DualPipeV;
with v = 1 the chunk is the stage itself. The split-backward tables (ZB-H1, ZB-V,
DualPipeV) are in zerobubble.py.
"""

from __future__ import annotations

from typing import NamedTuple

V_SCHEDULES = ("zb_v", "dualpipev")  # two chunks per rank, placed in a V
SPLIT_SCHEDULES = ("zb_h1",) + V_SCHEDULES  # tables with I and W actions


class Action(NamedTuple):
    phase: str  # "F", "B", "I" or "W"
    mb: int
    chunk: int
    overlap = False  # a class attribute, not a field: see Overlapped


class Overlapped(Action):
    """A forward run overlapped with the backward right after it in the table (DualPipe's
    F&B: each one's communication hides behind the other's compute); equal to the plain
    Action of the same fields."""

    __slots__ = ()
    overlap = True


def placement_style(schedule: str) -> str:
    """``v`` for the V-shaped schedules, else ``loop``."""
    return "v" if schedule in V_SCHEDULES else "loop"


def chunk_stage(chunk: int, p: int, style: str = "loop") -> int:
    """Pipeline rank of model chunk ``chunk``. loop: c % p (Megatron's interleaving). v: the
    first p chunks down the ranks, the next p back up (chunk c < p on rank c, chunk c >= p on
    rank 2p - 1 - c; ZB-V, Qi et al. 2023 §6; torch's generate_stage_to_rank_mapping "v")."""
    lap, k = divmod(chunk, p)
    return p - 1 - k if style == "v" and lap % 2 else k


def stage_chunks(stage: int, p: int, v: int, style: str = "loop") -> list[int]:
    """The model chunks pipeline rank ``stage`` holds, in pipeline order."""
    return [c for c in range(p * v) if chunk_stage(c, p, style) == stage]


def gpipe(p: int, m: int, stage: int) -> list[Action]:
    """GPipe (Huang et al. 2019): all m forwards, then all m backwards.

    Warm-up: m forwards. Steady state: none. Cool-down: m backwards, in order.
    In flight at the peak: m micro-batches on every stage.
    """
    return [Action("F", i, stage) for i in range(m)] + [Action("B", i, stage) for i in range(m)]


def one_f_one_b(p: int, m: int, stage: int) -> list[Action]:
    """1F1B / PipeDream-Flush (Narayanan et al. 2021, §2.2.1).

    Warm-up: min(p - i - 1, m) forwards on stage i. Steady state: m - warm-up pairs of
    one forward then one backward. Cool-down: the warm-up's backwards. In flight at the
    peak: p - i micro-batches on stage i (p on the first).
    """
    warm = min(p - stage - 1, m)
    out = [Action("F", i, stage) for i in range(warm)]
    f, b = warm, 0
    for _ in range(m - warm):
        out.append(Action("F", f, stage))
        f += 1
        out.append(Action("B", b, stage))
        b += 1
    out += [Action("B", i, stage) for i in range(b, m)]
    return out


def _virtual(k: int, p: int, v: int, forward: bool) -> tuple[int, int]:
    """Micro-batch and chunk of the k-th virtual micro-batch of a stage (Megatron's table)."""
    group = k // (p * v)
    chunk = (k // p) % v
    mb = group * p + k % p
    return mb, chunk if forward else v - 1 - chunk


def interleaved_warmup(p: int, m: int, stage: int, v: int) -> int:
    """Virtual forwards stage ``stage`` runs before its first backward, less the steady
    state's first: min(2(p - i - 1) + (v - 1)p, m v) (Megatron's num_warmup_microbatches)."""
    return min(2 * (p - stage - 1) + (v - 1) * p, m * v)


def interleaved(p: int, m: int, stage: int, v: int) -> list[Action]:
    """Interleaved 1F1B with v chunks per stage (Narayanan et al. 2021, §2.2.2).

    Needs m to be a multiple of p. Forwards run micro-batches in groups of p through
    chunk 0, then chunk 1, ... (backwards through the chunks in reverse). Warm-up:
    min(2(p - i - 1) + (v - 1)p, m v) virtual forwards on stage i. Steady state: one
    forward then one backward. Cool-down: the remaining backwards. Chunk c of a stage is
    model chunk stage + c * p.
    """
    total = m * v
    warm = interleaved_warmup(p, m, stage, v)
    out: list[Action] = []
    for k in range(warm):
        mb, c = _virtual(k, p, v, True)
        out.append(Action("F", mb, stage + c * p))
    f, b = warm, 0
    for _ in range(total - warm):
        mb, c = _virtual(f, p, v, True)
        out.append(Action("F", mb, stage + c * p))
        f += 1
        mb, c = _virtual(b, p, v, False)
        out.append(Action("B", mb, stage + c * p))
        b += 1
    while b < total:
        mb, c = _virtual(b, p, v, False)
        out.append(Action("B", mb, stage + c * p))
        b += 1
    return out


def stage_order(schedule: str, p: int, m: int, stage: int, v: int = 1) -> list[Action]:
    """The action table of one stage for gpipe, 1f1b or interleaved (every schedule:
    tables.stage_table)."""
    if p == 1:
        return gpipe(1, m, 0) if schedule == "gpipe" else one_f_one_b(1, m, 0)
    if schedule == "gpipe":
        return gpipe(p, m, stage)
    if schedule == "1f1b":
        return one_f_one_b(p, m, stage)
    if schedule == "interleaved":
        return interleaved(p, m, stage, v)
    raise ValueError(f"unknown pipeline schedule {schedule!r}")


class TableDeadlock(RuntimeError):
    """Tables that cannot finish; ``blocked``: (stage, position, action) of each stuck stage."""

    def __init__(self, blocked: list[tuple[int, int, Action]]):
        self.blocked = blocked
        super().__init__("pipeline tables deadlock; blocked: " + ", ".join(
            f"stage {s}: {a.phase}{a.mb} of chunk {a.chunk}" for s, _, a in blocked))


class TableRun(NamedTuple):
    """The tables run with fixed action times and free communication."""

    makespan: float
    busy: list[float]
    """Compute time of each stage."""
    end: dict[tuple[str, int, int], float]
    """When each action ended, by (phase, mb, chunk)."""

    def idle(self, stage: int) -> float:
        """The stage's bubble: the step's time it does not compute."""
        return self.makespan - self.busy[stage]


def table_order(orders: list[list[Action]]) -> list[tuple[int, list[Action], list]]:
    """The order the stages' tables run in, each action (or DualPipe's overlapped pair) as
    soon as its inputs exist (``action_needs``), sweeping the stages in turn: (stage, the
    actions, what they wait for) per step. It does not depend on the actions' times, so
    ``run_tables`` times it and the search's bubble walk compiles it once per shape.
    Raises TableDeadlock naming the first blocked action of each stuck stage."""
    p = len(orders)
    last = max((a.chunk for o in orders for a in o), default=0)
    made: set[tuple[str, int, int]] = set()
    pos, out = [0] * p, []
    progressed = True
    while progressed:
        progressed = False
        for s in range(p):
            order = orders[s]
            while pos[s] < len(order):
                group = order[pos[s]:pos[s] + 2] if order[pos[s]].overlap else order[pos[s]:pos[s] + 1]
                deps = [n for a in group for n in action_needs(a, last)]
                if any(n not in made for n in deps):
                    break
                out.append((s, group, deps))
                for a in group:
                    made.add((a.phase, a.mb, a.chunk))
                    if a.phase in ("B", "I"):
                        made.add(("G", a.mb, a.chunk))
                pos[s] += len(group)
                progressed = True
    stuck = [(s, pos[s], orders[s][pos[s]]) for s in range(p) if pos[s] < len(orders[s])]
    if stuck:
        raise TableDeadlock(stuck)
    return out


def run_tables(orders: list[list[Action]], v: int, t_f: float = 1.0, t_b: float = 2.0,
               t_w: float | None = None, t_fb: float | None = None) -> TableRun:
    """Run every stage's table in order, each action as soon as its inputs exist.

    Per chunk a forward takes t_f / v, a whole backward B t_b / v, its halves W t_w / v and
    I (t_b - t_w) / v (t_w: t_b / 2 unless given), and an overlapped forward and backward
    pair (DualPipe's F&B) t_fb / v (default: the two in turn). F(mb, c) waits for F(mb,
    c - 1); B or I(mb, c) for F(mb, c) and the input gradient of (mb, c + 1) (its B or I);
    W(mb, c) for I(mb, c). Raises TableDeadlock naming the first blocked action of each stuck
    stage if the tables deadlock.
    """
    t_w = t_b / 2 if t_w is None else t_w
    cost = {"F": t_f / v, "B": t_b / v, "I": (t_b - t_w) / v, "W": t_w / v}
    p = len(orders)
    done: dict[tuple[str, int, int], float] = {}
    end: dict[tuple[str, int, int], float] = {}
    clock, busy = [0.0] * p, [0.0] * p
    for s, group, deps in table_order(orders):
        t = sum(cost[a.phase] for a in group)
        if len(group) == 2 and t_fb is not None:
            t = t_fb / v
        start = max([clock[s]] + [done[n] for n in deps])
        clock[s] = start + t
        busy[s] += t
        for a in group:
            end[(a.phase, a.mb, a.chunk)] = clock[s]
            done[(a.phase, a.mb, a.chunk)] = clock[s]
            if a.phase in ("B", "I"):
                done[("G", a.mb, a.chunk)] = clock[s]
    return TableRun(max(clock, default=0.0), busy, end)


def action_needs(a: Action, last: int) -> list[tuple[str, int, int]]:
    """What an action waits for (``last``: the last chunk): F the previous chunk's F of its
    micro-batch; a backward (B or I) its own F and the next chunk's input gradient ("G");
    W its own input gradient."""
    if a.phase == "F":
        return [("F", a.mb, a.chunk - 1)] if a.chunk > 0 else []
    if a.phase == "W":
        return [("G", a.mb, a.chunk)]
    return [("F", a.mb, a.chunk)] + ([("G", a.mb, a.chunk + 1)] if a.chunk < last else [])


def ideal_makespan(orders: list[list[Action]], p: int, v: int, t_f: float = 1.0,
                   t_b: float = 2.0, t_w: float | None = None, t_fb: float | None = None) -> float:
    """Step time of the tables with free communication and uniform chunks (``run_tables``:
    forward t_f / v, backward t_b / v = I + W with W t_w / v). Raises if they deadlock."""
    return run_tables(orders[:p], v, t_f, t_b, t_w, t_fb).makespan


def peak_in_flight(order: list[Action]) -> int:
    """Most chunk micro-batches a stage holds activations for at once: a forward adds one,
    its backward's end (B, or W after I) releases it."""
    live = peak = 0
    for a in order:
        live += 1 if a.phase == "F" else -1 if a.phase in ("B", "W") else 0
        peak = max(peak, live)
    return peak
