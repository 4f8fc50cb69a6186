"""The one Chrome/Perfetto exporter of a trace (twin and executor runs alike).

Slices ("X") per op: pid per node, tid per (rank, stream) (concurrent ops of a stream,
such as p2p, on extra numbered tids); send->recv flow arrows; memory counters ("C"): a
track per rank of live bytes per category (GiB), restarting at each step as the summary
counts them. Times in microseconds.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from twin.files import write_text_atomic
from twin.metrics import live_series
from twin.rundir import CHROME_FALLBACK, check_replace, is_trace_file
from twin.trace import Span, Trace
from twin.vocab import GIB, MEMORY_KINDS


def _inside(start_us: float, end_us: float, at_end: bool) -> float:
    """A time strictly inside [start, end] near one end: a flow event exactly on a slice's
    edge may bind to no slice (or the neighbour) in Perfetto and chrome://tracing."""
    d = max(end_us - start_us, 0.0)
    eps = min(d / 2, 0.001)
    return end_us - eps if at_end else start_us + eps


def _slots(spans: list[Span]) -> list[int]:
    """Sub-track of each span so that spans on one track never overlap: Chrome's format
    needs slices on a thread to nest, and p2p ops (isend/irecv) run concurrently."""
    slot = [0] * len(spans)
    ends: dict[tuple[int, str], list[float]] = {}
    for i in sorted(range(len(spans)), key=lambda i: (spans[i].start_us, spans[i].end_us)):
        s = spans[i]
        if s.kind in MEMORY_KINDS:
            continue
        free = ends.setdefault((s.rank, s.stream), [])
        k = next((k for k, e in enumerate(free) if e <= s.start_us), len(free))
        if k == len(free):
            free.append(s.end_us)
        else:
            free[k] = s.end_us
        slot[i] = k
    return slot


def _slices(trace: Trace, gpus_per_node: int | None = None) -> dict:
    """Chrome/Perfetto trace events: pid per node, tid per (rank, stream) (concurrent ops of
    a stream, such as p2p, on extra numbered tids), times in us, flow arrows from each send
    to its recv. Lanes sort by rank, then compute, comm, p2p, mem."""
    gpn = gpus_per_node or trace.meta.get("gpus_per_node") or 8
    order = {"compute": 0, "p2p": 2, "mem": 3}
    slots = _slots(trace.spans)
    keys = sorted({(s.rank, s.stream, k) for s, k in zip(trace.spans, slots)},
                  key=lambda k: (k[0], order.get(k[1], 1), k[1], k[2]))
    tids: dict[tuple[int, str, int], int] = {}
    events: list[dict] = []
    for key in keys:
        tids[key] = len(tids) + 1
        pid, tid = key[0] // gpn, tids[key]
        name = f"rank {key[0]} {key[1]}" + (f" #{key[2] + 1}" if key[2] else "")
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                       "args": {"name": name}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                       "args": {"sort_index": tid}})
    where: dict[int, int] = {}
    for i, (s, k) in enumerate(zip(trace.spans, slots)):
        pid, tid = s.rank // gpn, tids[(s.rank, s.stream, k)]
        where[i] = tid
        args = {"op": s.op, "step": s.step, "bytes": s.bytes, "flops": s.flops}
        if s.kind in MEMORY_KINDS:
            events.append({"ph": "i", "s": "t", "name": f"{s.kind} {s.category}", "pid": pid,
                           "tid": tid, "ts": s.start_us, "args": args})
            continue
        events.append({"ph": "X", "name": s.op, "cat": s.kind, "pid": pid, "tid": tid,
                       "ts": s.start_us, "dur": max(s.dur_us, 0.0), "args": args})
    nodes = sorted({s.rank // gpn for s in trace.spans})
    for n in nodes:
        events.append({"ph": "M", "name": "process_name", "pid": n, "args": {"name": f"node {n}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": n, "args": {"sort_index": n}})
    sends = {(s.step, s.rank, s.peer, s.tag): i for i, s in enumerate(trace.spans)
             if s.kind == "send"}
    flow = 0
    for i, s in enumerate(trace.spans):
        if s.kind != "recv" or (s.step, s.peer, s.rank, s.tag) not in sends:
            continue
        j = sends[(s.step, s.peer, s.rank, s.tag)]
        src = trace.spans[j]
        flow += 1
        events.append({"ph": "s", "id": flow, "name": "p2p", "cat": "p2p",
                       "pid": src.rank // gpn, "tid": where[j],
                       "ts": _inside(src.start_us, src.end_us, at_end=False)})
        events.append({"ph": "f", "bp": "e", "id": flow, "name": "p2p", "cat": "p2p",
                       "pid": s.rank // gpn, "tid": where[i],
                       "ts": _inside(s.start_us, s.end_us, at_end=True)})
    # otherData first: the head of the file says who wrote it (twin.rundir.is_kind)
    return {"otherData": {"generator": "paratwin"}, "traceEvents": events, "displayTimeUnit": "ms"}


def chrome_trace(trace: Trace, gpus_per_node: int | None = None) -> dict:
    """The Chrome/Perfetto export of ``trace``: slices, flows and a memory counter per rank."""
    data = _slices(trace, gpus_per_node)
    gpn = gpus_per_node or trace.meta.get("gpus_per_node") or 8
    by_rank = defaultdict(list)
    for s in trace.spans:
        if s.kind in MEMORY_KINDS:
            by_rank[s.rank].append(s)
    for rank, spans in sorted(by_rank.items()):
        times, cats, values = live_series(spans)
        for t, row in zip(times, values):
            data["traceEvents"].append({"ph": "C", "name": f"memory rank {rank} (GiB)",
                                        "pid": rank // gpn, "ts": float(t),
                                        "args": {c: round(float(v) / GIB, 6) for c, v in zip(cats, row)}})
    return data


def write_chrome(trace: Trace, path: Path, gpus_per_node: int | None = None) -> Path:
    """Write the export atomically (compact JSON); never over a paratwin trace."""
    path = Path(path)
    if path.is_file() and is_trace_file(path):
        raise ValueError(f"{path} holds a paratwin trace; the Chrome export must not overwrite it "
                         f"(write it to {path.with_name(CHROME_FALLBACK)})")
    check_replace(path, "chrome")
    return write_text_atomic(path, json.dumps(chrome_trace(trace, gpus_per_node),
                                              separators=(",", ":")))
