"""A split-backward pipeline whose host waits at every exchange: its makespan by a walk.

With ``CostModel.p2p_host_sync`` (Megatron's ``batch_isend_irecv``, wait, synchronize) the
host of a stage stops after each run of consecutive sends and recvs until they and the work
before them have finished (``twin.sim.host``). torch's runtime posts a split-backward
table's recvs early, at the receiver's point when the sender's action runs
(``twin.schedule.zerobubble.post_recvs``); a host that then waits for such a recv waits for
the sender, and cannot issue the weight-gradient work a free pipeline would slide into the
gap. The tables' bubble (``twin.search.bubble``) misses that: on GPT-3 175B on 1,024 A100s
the estimate put ZB-V and ZB-H1 plans 24-34% faster than the twin simulates them.

The walk runs each stage's lowered table as the twin does, with each stage's times
(forward f, backward b, of which W w; per chunk of v), a transfer c: a compute op starts
when the device is free, the host has issued it (at the last sync) and its input arrived; a
transfer runs from max(the send's compute end, both hosts' posting times) for c; a sync sets
the stage's device and host clock to the end of everything it waits for. Stages advance
round-robin as far as what their peers have done allows. Like the tables' bubble it is
homogeneous in the times, so each (schedule, p, m', the stages' times and c over the
largest forward) is walked once (ratios binned by 4%, ``COARSE``), and past m = 2p + 4 the
steady state adds the same time per micro-batch: T(m) = T(2p) + (m - 2p) (T(2p + 4) - T(2p)) / 4.
"""

from __future__ import annotations

import math
from functools import lru_cache

from twin.schedule.pipeline import V_SCHEDULES, chunk_stage, placement_style
from twin.schedule.tables import stage_table
from twin.schedule.zerobubble import input_chunk, output_chunk, post_recvs, transfer_key
from twin.search.buckets import bucket_sizes
from twin.workload.context import dp_dims

Key = tuple[str, int, int]
"""A transfer: (F for an activation or G for a gradient, micro-batch, consumer chunk)."""


@lru_cache(maxsize=64)
def _programs(schedule: str, p: int, m: int) -> tuple[tuple[tuple, ...], ...]:
    """Per stage, its ops in program order: ("c", phase, the remote input's key or None) for
    each action (an overlapped pair's two in turn, as the twin lowers them), ("s", key),
    ("r", key), and ("y",) where the host syncs (after each run of consecutive sends and
    recvs)."""
    v = 2 if schedule in V_SCHEDULES else 1
    placement = tuple(chunk_stage(c, p, placement_style(schedule)) for c in range(p * v))
    orders = [stage_table(schedule, p, m, s, v) for s in range(p)]
    last = p * v - 1
    out = []
    for s, items in enumerate(post_recvs(orders, placement)):
        ops: list[tuple] = []
        for kind, a in items:
            if kind == "recv":
                ops.append(("r", transfer_key(a)))
                continue
            src, dst = input_chunk(a, last), output_chunk(a, last)
            remote = src is not None and placement[src] != s
            ops.append(("c", a.phase, transfer_key(a) if remote else None))
            if dst is not None and placement[dst] != s:
                ops.append(("s", transfer_key(a._replace(chunk=dst))))
        synced: list[tuple] = []
        for i, op in enumerate(ops):
            synced.append(op)
            if op[0] in "sr" and (i + 1 == len(ops) or ops[i + 1][0] not in "sr"):
                synced.append(("y",))
        out.append(tuple(synced))
    return tuple(out)


def walk_sync(schedule: str, p: int, m: int, f, b, w, c: float, sync: bool = True,
              r=0.0) -> float:
    """The makespan of ``schedule``'s lowered tables under host syncs (module docstring);
    ``f``, ``b``, ``w``: one micro-batch's forward, backward and its weight-gradient part,
    per stage (sequences) or the same on every stage; ``r``: how far the gradient reductions
    a micro-batch's W passes issue (gradients reduced every micro-batch) run past them, which
    the host's next sync waits for (``synced_reductions_s``); ``sync=False``: a host that
    never waits (the tables' own walk, transfers included)."""
    v = 2 if schedule in V_SCHEDULES else 1
    per = [tuple(x) if isinstance(x, (tuple, list)) else (x,) * p for x in (f, b, w, r)]
    dur = [{"F": fs / v, "B": bs / v, "I": (bs - ws) / v, "W": ws / v}
           for fs, bs, ws, _ in zip(*per)]
    tail = [rs / v for rs in per[3]]
    reduced = [0.0] * p  # when the reductions issued after each W end
    programs = _programs(schedule, p, m)
    ready: dict[Key, float] = {}  # the send's compute end and its host's issue
    posted: dict[Key, float] = {}  # when the recv's host posted it
    dev = [0.0] * p
    host = [0.0] * p
    pos = [0] * p
    run: list[list[Key]] = [[] for _ in range(p)]

    def arrival(key: Key) -> float | None:
        if key in ready and key in posted:
            return max(ready[key], posted[key]) + c
        return None

    while True:
        progressed = False
        for s, ops in enumerate(programs):
            while pos[s] < len(ops):
                op = ops[pos[s]]
                if op[0] == "c":
                    start = max(dev[s], host[s])
                    if op[2] is not None:
                        got = arrival(op[2])
                        if got is None:
                            break
                        start = max(start, got)
                    dev[s] = start + dur[s][op[1]]
                    if op[1] in "BW" and tail[s]:  # its buckets, after those before them
                        reduced[s] = max(reduced[s], dev[s]) + tail[s]
                elif op[0] == "s":
                    ready[op[1]] = max(dev[s], host[s])
                    run[s].append(op[1])
                elif op[0] == "r":
                    posted[op[1]] = host[s]
                    run[s].append(op[1])
                elif sync:  # the host waits for the run's transfers and the work before them
                    ends = [arrival(k) for k in run[s]]
                    if any(e is None for e in ends):
                        break
                    host[s] = dev[s] = max([dev[s], reduced[s], *ends])
                    run[s] = []
                pos[s] += 1
                progressed = True
        if all(pos[s] == len(ops) for s, ops in enumerate(programs)):
            return max(dev)
        if not progressed:
            raise ValueError(f"{schedule} p={p} m={m}: the host-synced exchange deadlocks")


@lru_cache(maxsize=1 << 15)
def _unit_makespan(schedule: str, p: int, m: int, fs: tuple, bs: tuple, ws: tuple,
                   c: float, rs: tuple) -> float:
    return walk_sync(schedule, p, m, fs, bs, ws, c, r=rs)


STEADY = 4
"""Micro-batches past 2p walked to measure the steady state's time per micro-batch."""
COARSE = math.log(1.04)
C_STEP = 0.002
"""The walk's cache key: each stage's times over the largest forward on a geometric grid of 4%
steps, the transfer on steps of 0.2% of it (a search meets thousands of plans whose stages
differ by less: each walk of p = 64 stages takes milliseconds)."""


R_COARSE = math.log(1.1)
R_FLOOR = 0.01
"""The reductions' excess past W on a coarser grid (10% steps), none below 1% of the largest
forward: it varies with every data-parallel layout, and each distinct walk costs milliseconds."""


def _coarse(x: float, step: float = COARSE) -> float:
    return math.exp(round(math.log(x) / step) * step) if x > 0 else 0.0


def synced_pipeline_s(schedule: str, p: int, m: int, fs: list[float], bs: list[float],
                      ws: list[float], c: float, rs: list[float] | None = None) -> float:
    """First forward to last backward of a host-synced split-backward pipeline (per stage
    one micro-batch's forward, backward and its weight-gradient part, without exchanges; c
    one transfer; ``rs`` its reductions' excess past W, walk_sync's ``r``). The times are
    scaled by the largest forward and binned (``_coarse``)."""
    f = max(fs)
    if f <= 0:
        return 0.0
    key = (tuple(_coarse(x / f) for x in fs), tuple(_coarse(x / f) for x in bs),
           tuple(_coarse(min(x, y) / f) for x, y in zip(ws, bs)), round(c / f / C_STEP) * C_STEP,
           tuple(_coarse(x / f, R_COARSE) if x > R_FLOOR * f else 0.0 for x in rs or [0.0] * len(fs)))
    if m <= 2 * p + STEADY:
        return f * _unit_makespan(schedule, p, m, *key)
    t0, t1 = (_unit_makespan(schedule, p, 2 * p + k, *key) for k in (0, STEADY))
    return f * (t0 + (m - 2 * p) * (t1 - t0) / STEADY)


def synced_reductions_s(job, comm, b: float, layers: int) -> float:
    """What one micro-batch's backward of a stage adds when its host waits at each exchange
    and its gradients are reduced every micro-batch (ZeRO-2, FSDP, ``grad_sync=every``):
    after each chunk's backward the host waits for the chunk's reductions, issued one after
    another on the stream: DDP's and ZeRO's buckets (``twin.schedule.data``: in reverse
    registration order, each when its last gradient is ready), FSDP's reduce-scatter of each
    layer. A reduction's gradients are taken ready as the backward has run the share of the
    chunk's parameters up to it; the wait is how far the last reduction ends past the
    backward. ``b``: the stage's backward of one micro-batch over its v chunks (a split
    backward's W pass, which makes the gradients); ``layers``: the stage's layers."""
    par = job.parallel
    if not par.sync_every_microbatch or par.zero_stage == 3 or par.dp * par.cp <= 1:
        return 0.0  # (FSDP's reduce-scatters: twin.search.fsdpwalk)
    v = par.pp_virtual_stages
    e = job.model.dtype_bytes
    sizes = bucket_sizes(job.model, par.tp, max(1, layers // v), e, par.ddp_bucket_MB)
    a, per_byte = comm.affine(job, "all_reduce" if par.zero_stage == 0 else "reduce_scatter",
                              dp_dims(par))
    whole = sum(sizes)
    chunk = b / v
    done = end = 0.0
    for numel in sizes:
        done += numel
        end = max(end, chunk * done / whole) + a + numel * e * per_byte
    return v * max(0.0, end - chunk)

