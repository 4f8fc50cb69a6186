"""Pipeline schedules as pure tables: the (phase, micro-batch, chunk) order of each stage.

An action is ("F" | "B", micro-batch, chunk). Chunk c of the model lives on stage
c % p (Megatron's interleaving), so with v = 1 the chunk is the stage itself.
"""

from __future__ import annotations

from typing import NamedTuple


class Action(NamedTuple):
    phase: str  # "F" or "B"
    mb: int
    chunk: int


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
    """The action table of one stage for a named schedule."""
    if p == 1:
        return gpipe(1, m, 0) if schedule == "gpipe" else one_f_one_b(1, m, 0)
    if schedule == "gpipe":
        return gpipe(p, m, stage)
    if schedule == "1f1b":
        return one_f_one_b(p, m, stage)
    if schedule == "interleaved":
        return interleaved(p, m, stage, v)
    raise ValueError(f"unknown pipeline schedule {schedule!r}")


def ideal_makespan(orders: list[list[Action]], p: int, v: int, t_f: float = 1.0,
                   t_b: float = 2.0) -> float:
    """Step time of the tables with free communication and uniform chunks.

    A chunk's forward takes t_f / v and its backward t_b / v. F(mb, c) waits for
    F(mb, c - 1) (on the previous stage), B(mb, c) for B(mb, c + 1) and F(mb, c);
    each stage runs its table in order. Raises if the tables deadlock.
    """
    done: dict[tuple[str, int, int], float] = {}
    pos = [0] * p
    clock = [0.0] * p
    last = p * v - 1
    progressed = True
    while progressed:
        progressed = False
        for s in range(p):
            while pos[s] < len(orders[s]):
                a = orders[s][pos[s]]
                if a.phase == "F":
                    need = [("F", a.mb, a.chunk - 1)] if a.chunk > 0 else []
                    cost = t_f / v
                else:
                    need = [("F", a.mb, a.chunk)]
                    need += [("B", a.mb, a.chunk + 1)] if a.chunk < last else []
                    cost = t_b / v
                if any(n not in done for n in need):
                    break
                start = max([clock[s]] + [done[n] for n in need])
                clock[s] = start + cost
                done[(a.phase, a.mb, a.chunk)] = clock[s]
                pos[s] += 1
                progressed = True
    if any(pos[s] < len(orders[s]) for s in range(p)):
        raise RuntimeError("pipeline tables deadlock")
    return max(clock)
