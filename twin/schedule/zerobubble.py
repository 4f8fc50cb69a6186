"""Pipeline tables with a split backward: ZB-H1, ZB-V and DualPipeV (actions F, I, W, B).

The backward of a chunk splits into I, the input gradient the previous stage waits for,
and W, the weight gradient nobody waits for but the optimizer (Qi et al. 2023, "Zero
Bubble Pipeline Parallelism", §2): W can move later and fill the bubbles. The action
orders follow torch 2.13's ``ScheduleInterleavedZeroBubble`` (one chunk per rank: ZB-H1),
``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` (torch/distributed/pipelining/
schedules.py), without the empty slots those tables carry for alignment.
"""

from __future__ import annotations

from collections import deque

from twin.schedule.pipeline import Action, Overlapped


def zb_h1(p: int, m: int, stage: int) -> list[Action]:
    """ZB-H1 (Qi et al. 2023, §3.1, Fig. 3): 1F1B with each backward split, W delayed.

    Warm-up: min(p - i - 1, m) forwards on stage i, as 1F1B. Steady state: F then I; from
    the (i + 1)-th backward on, each I is followed by the oldest pending W (stage i holds i
    Ws back, filling the bubbles of the cool-down). Cool-down: I then W; then the remaining
    Ws. In flight at the peak: min(p, m) micro-batches on every stage (1F1B's peak, on
    stage 0). Bubble (p - 1)(F + B - 2W) for the whole backward B = I + W.
    """
    warm = min(p - stage - 1, m)
    out = [Action("F", i, stage) for i in range(warm)]
    w = 0
    for k in range(m):
        if k < m - warm:
            out.append(Action("F", warm + k, stage))
        out.append(Action("I", k, stage))
        if k >= stage:
            out.append(Action("W", w, stage))
            w += 1
    out += [Action("W", i, stage) for i in range(w, m)]
    return out


def zb_v(p: int, m: int, stage: int) -> list[Action]:
    """ZB-V (Qi et al. 2023, §6): two chunks per rank in a V, chunk i and chunk 2p - 1 - i.

    With m' = max(m, 2p - 1) (a full pipeline; actions of micro-batches >= m are dropped):
    warm-up 2(p - i) - 1 forwards of the first chunk, then i pairs F(second), F(first),
    then p - i rounds F, I, W of the second chunk. Steady state: F, I, W of the first
    chunk, then of the second, until every forward ran. Cool-down: i pairs I(first),
    I(second); p - i rounds I, W of the first chunk; then the pending Ws, second chunk
    first. Zero bubble when F = I = W; peak activations of 1F1B (2p half-stage chunks).
    """
    n = max(2 * p - 1, m)
    c0, c1 = stage, 2 * p - 1 - stage
    nxt = {("F", c0): 0, ("F", c1): 0, ("I", c0): 0, ("I", c1): 0, ("W", c0): 0, ("W", c1): 0}
    out: list[Action] = []

    def add(phase: str, chunk: int) -> None:
        out.append(Action(phase, nxt[(phase, chunk)], chunk))
        nxt[(phase, chunk)] += 1

    for _ in range(2 * (p - stage) - 1):
        add("F", c0)
    for _ in range(stage):
        add("F", c1)
        add("F", c0)
    for _ in range(p - stage):
        add("F", c1)
        add("I", c1)
        add("W", c1)
    while nxt[("F", c1)] < nxt[("F", c0)] or nxt[("F", c0)] < n:
        if nxt[("F", c0)] < n:
            add("F", c0)
        add("I", c0)
        add("W", c0)
        add("F", c1)
        add("I", c1)
        add("W", c1)
    for _ in range(stage):
        add("I", c0)
        add("I", c1)
    for _ in range(p - stage):
        add("I", c0)
        add("W", c0)
    while nxt[("W", c1)] < nxt[("I", c1)]:
        add("W", c1)
    while nxt[("W", c0)] < nxt[("I", c0)]:
        add("W", c0)
    return [a for a in out if a.mb < m]


def dualpipev(p: int, m: int, stage: int) -> list[Action]:
    """DualPipeV (DeepSeek-V3 report, 2024, §3.2.1; deepseek-ai/DualPipe's "V" cut in half).

    Chunks i and 2p - 1 - i on rank i; needs m >= 2p. Eight steps on rank i: 2(p - i - 1)
    forwards of the first chunk; i + 1 pairs F(first), F(second); p - i - 1 rounds I, W,
    F of the second chunk; the main step, m - 2p + i + 1 times an overlapped F(first)&B(second)
    then F(second)&B(first) (the last rank runs its first pair apart); p - i - 1 rounds
    B(second), then F(second)&B(first); i + 1 rounds backward of the second then the first
    chunk, switching to I (W deferred) halfway; p - i - 1 rounds W, backward of the first
    chunk; i + 1 Ws. Overlapped pairs carry ``overlap=True`` on their forward. Bubble
    (p - 1)(F&B + B - 3W) in chunk times (DualPipe's README: (PP/2 - 1) with PP = 2p chunks).
    """
    c0, c1 = stage, 2 * p - 1 - stage
    nf = {c0: 0, c1: 0}
    nb = {c0: 0, c1: 0}
    weights: deque[tuple[int, int]] = deque()
    out: list[Action] = []

    def fwd(c: int, overlap: bool = False) -> None:
        out.append((Overlapped if overlap else Action)("F", nf[c], c))
        nf[c] += 1

    def bwd(c: int, split: bool = False) -> None:
        out.append(Action("I" if split else "B", nb[c], c))
        if split:
            weights.append((nb[c], c))
        nb[c] += 1

    def weight() -> None:
        if weights:
            mb, c = weights.popleft()
            out.append(Action("W", mb, c))

    for _ in range(2 * (p - stage - 1)):
        fwd(c0)
    for _ in range(stage + 1):
        fwd(c0)
        fwd(c1)
    for _ in range(p - stage - 1):
        bwd(c1, split=True)
        weight()
        fwd(c1)
    for i in range(m - 2 * p + stage + 1):
        fwd(c0, overlap=not (i == 0 and stage == p - 1))
        bwd(c1)
        fwd(c1, overlap=True)
        bwd(c0)
    for _ in range(p - stage - 1):
        bwd(c1)
        fwd(c1, overlap=True)
        bwd(c0)
    split = False
    half = (stage + 1) // 2
    for i in range(stage + 1):
        split = split or (i == half and stage % 2 == 1)
        bwd(c1, split)
        split = split or (i == half and stage % 2 == 0)
        bwd(c0, split)
    for _ in range(p - stage - 1):
        weight()
        bwd(c0, split)
    for _ in range(stage + 1):
        weight()
    return out


def input_chunk(a: Action, last: int) -> int | None:
    """The chunk ``a``'s input comes from (``last``: the last chunk), None: none."""
    if a.phase == "F":
        return a.chunk - 1 if a.chunk > 0 else None
    return a.chunk + 1 if a.phase in ("B", "I") and a.chunk < last else None


def output_chunk(a: Action, last: int) -> int | None:
    """The chunk ``a``'s output goes to, None: none."""
    if a.phase == "F":
        return a.chunk + 1 if a.chunk < last else None
    return a.chunk - 1 if a.phase in ("B", "I") and a.chunk > 0 else None


def transfer_key(a: Action) -> tuple[str, int, int]:
    """What ``a`` receives: (F an activation or G a gradient, micro-batch, its chunk)."""
    return ("F" if a.phase == "F" else "G", a.mb, a.chunk)


def post_recvs(orders: list[list[Action]], placement: tuple[int, ...]) -> list[list[tuple[str, Action]]]:
    """Each stage's table with the points where it posts its recvs: items ("recv", consumer)
    or ("act", action), as torch 2.13's runtime lowers a compute-only table
    (``_add_send_recv``): the stages' tables are walked together, an action (an overlapped
    pair as one) runs once its inputs were received or made on its own rank, and each
    remote send puts the matching recv at the receiver's current point. Sends between two
    ranks and their recvs are so posted in the same order (NCCL pairs them by order)."""
    last = len(placement) - 1
    out: list[list[tuple[str, Action]]] = [[] for _ in orders]
    have: list[set[tuple[str, int, int]]] = [set() for _ in orders]  # inputs a stage holds
    pos = [0] * len(orders)

    def source(a: Action) -> int | None:
        return input_chunk(a, last)

    def dest(a: Action) -> int | None:
        return output_chunk(a, last)

    key = transfer_key

    while any(pos[s] < len(o) for s, o in enumerate(orders)):
        progressed = False
        for s, order in enumerate(orders):
            if pos[s] >= len(order):
                continue
            group = order[pos[s]:pos[s] + (2 if order[pos[s]].overlap else 1)]
            if any(source(a) is not None and key(a) not in have[s] for a in group):
                continue
            for a in group:
                out[s].append(("act", a))
                d = dest(a)
                if d is not None:
                    r = placement[d]
                    consumer = Action("F" if a.phase == "F" else "B", a.mb, d)
                    if r != s:
                        out[r].append(("recv", consumer))
                    have[r].add(key(consumer))
            pos[s] += len(group)
            progressed = True
        if not progressed:
            stuck = [f"stage {s}: {orders[s][pos[s]]}" for s in range(len(orders))
                     if pos[s] < len(orders[s])]
            raise RuntimeError("pipeline tables deadlock; blocked: " + ", ".join(stuck))
    return out
