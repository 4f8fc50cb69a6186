"""The one Chrome/Perfetto exporter of a trace (twin and executor runs alike).

Slices ("X") per op: pid per node, tid per (rank, stream) (concurrent ops of a stream,
such as p2p, on extra numbered tids); send->recv flow arrows; memory counters ("C"): a
track per rank of live bytes per category (GiB), restarting at each step as the summary
counts them. Times in microseconds.
"""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from collections.abc import Iterator
from json.encoder import encode_basestring_ascii
from pathlib import Path

import numpy as np

from twin.files import write_pieces_atomic
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
    needs slices on a thread to nest, and p2p ops (isend/irecv) run concurrently. First fit
    in order of (start, end); a track whose spans follow one another (most) is all slot 0."""
    slot = [0] * len(spans)
    lanes: dict[tuple[int, str], list[int]] = {}
    for i, s in enumerate(spans):
        if s.kind not in MEMORY_KINDS:
            lanes.setdefault((s.rank, s.stream), []).append(i)
    for idx in lanes.values():
        start = np.array([spans[i].start_us for i in idx], dtype=float)
        end = np.array([spans[i].end_us for i in idx], dtype=float)
        order = np.lexsort((end, start))  # stable: ties keep the spans' order
        if (start[order[1:]] >= end[order[:-1]]).all():
            continue  # each starts after the one before it ends: one track
        free: list[float] = []
        for j in order.tolist():
            k = next((k for k, e in enumerate(free) if e <= start[j]), len(free))
            if k == len(free):
                free.append(end[j])
            else:
                free[k] = end[j]
            slot[idx[j]] = k
    return slot


_str = encode_basestring_ascii
"""A string as json.dumps writes it (ASCII, escaped)."""


_ARGS = '"args":{"op":%s,"step":%s,"bytes":%s,"flops":%s}}'
_SLICE = '{"ph":"X","name":%s,"cat":%s,"pid":%d,"tid":%d,"ts":%s,"dur":%s,' + _ARGS
_MEM = '{"ph":"i","s":"t","name":%s,"pid":%d,"tid":%d,"ts":%s,' + _ARGS
"""A span's event as json.dumps writes its dict (strings and numbers given as JSON text)."""


_dump = json.JSONEncoder(separators=(",", ":")).encode
"""An event as compact JSON text (``json.dumps(event, separators=(",", ":"))``: one encoder
made once, not one per call)."""


def _events(trace: Trace, gpn: int) -> Iterator[str]:
    """The export's events, each as compact JSON text: threads' names and order, a slice
    ("X", or "i" for memory ops) per span, processes' names, send -> recv flow arrows, then
    a memory counter per rank. Slices are written without a dict each: the text is what
    json.dumps of the event writes (tests/report/test_chrome.py holds them equal)."""
    order = {"compute": 0, "p2p": 2, "mem": 3}
    spans = trace.spans
    slots = _slots(spans)
    keys = sorted({(s.rank, s.stream, k) for s, k in zip(spans, slots)},
                  key=lambda k: (k[0], order.get(k[1], 1), k[1], k[2]))
    tids: dict[tuple[int, str, int], int] = {}
    for key in keys:
        tids[key] = len(tids) + 1
        pid, tid = key[0] // gpn, tids[key]
        name = f"rank {key[0]} {key[1]}" + (f" #{key[2] + 1}" if key[2] else "")
        yield _dump({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
        yield _dump({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                     "args": {"sort_index": tid}})
    where = [tids[(s.rank, s.stream, k)] for s, k in zip(spans, slots)]
    for k0 in range(0, len(spans), CHUNK):
        chunk = spans[k0:k0 + CHUNK]
        # every number of the chunk formatted by json at once: ts, dur, step, bytes, flops
        nums = json.dumps([v for s in chunk for v in (s.start_us, max(s.dur_us, 0.0), s.step,
                                                      s.bytes, s.flops)])[1:-1].split(", ")
        for j, s in enumerate(chunk):
            op, pid, tid = _str(s.op), s.rank // gpn, where[k0 + j]
            if s.kind in MEMORY_KINDS:
                yield _MEM % (_str(f"{s.kind} {s.category}"), pid, tid, nums[5 * j], op,
                              *nums[5 * j + 2:5 * j + 5])
            else:
                yield _SLICE % (op, _str(s.kind), pid, tid, *nums[5 * j:5 * j + 2], op,
                                *nums[5 * j + 2:5 * j + 5])
    for n in sorted({s.rank // gpn for s in spans}):
        yield _dump({"ph": "M", "name": "process_name", "pid": n, "args": {"name": f"node {n}"}})
        yield _dump({"ph": "M", "name": "process_sort_index", "pid": n, "args": {"sort_index": n}})
    sends = {(s.step, s.rank, s.peer, s.tag): i for i, s in enumerate(spans) if s.kind == "send"}
    flow = 0
    for i, s in enumerate(spans):
        if s.kind != "recv" or (s.step, s.peer, s.rank, s.tag) not in sends:
            continue
        j = sends[(s.step, s.peer, s.rank, s.tag)]
        src = spans[j]
        flow += 1
        yield _dump({"ph": "s", "id": flow, "name": "p2p", "cat": "p2p", "pid": src.rank // gpn,
                     "tid": where[j], "ts": _inside(src.start_us, src.end_us, at_end=False)})
        yield _dump({"ph": "f", "bp": "e", "id": flow, "name": "p2p", "cat": "p2p",
                     "pid": s.rank // gpn, "tid": where[i],
                     "ts": _inside(s.start_us, s.end_us, at_end=True)})
    by_rank = defaultdict(list)
    for s in spans:
        if s.kind in MEMORY_KINDS:
            by_rank[s.rank].append(s)
    for rank, mine in sorted(by_rank.items()):
        times, cats, values = live_series(mine)
        for t, row in zip(times, values):
            yield _dump({"ph": "C", "name": f"memory rank {rank} (GiB)", "pid": rank // gpn,
                         "ts": float(t), "args": {c: round(float(v) / GIB, 6) for c, v in zip(cats, row)}})


CHUNK = 20_000
"""Events written per piece of text: the export is never held whole."""


def chrome_text(trace: Trace, gpus_per_node: int | None = None) -> Iterator[str]:
    """The export of ``trace`` as compact JSON, in pieces (``"".join`` them, or write them)."""
    gpn = gpus_per_node or trace.meta.get("gpus_per_node") or 8
    # otherData first: the head of the file says who wrote it (twin.rundir.is_kind)
    yield '{"otherData":{"generator":"paratwin"},"traceEvents":['
    events = _events(trace, gpn)
    first = True
    while True:
        piece = list(itertools.islice(events, CHUNK))
        if not piece:
            break
        yield ("" if first else ",") + ",".join(piece)
        first = False
    yield '],"displayTimeUnit":"ms"}'


def chrome_trace(trace: Trace, gpus_per_node: int | None = None) -> dict:
    """The Chrome/Perfetto export of ``trace``: slices, flows and a memory counter per rank
    (``chrome_text`` read back)."""
    return json.loads("".join(chrome_text(trace, gpus_per_node)))


def write_chrome(trace: Trace, path: Path, gpus_per_node: int | None = None) -> Path:
    """Write the export atomically (compact JSON); never over a paratwin trace."""
    path = Path(path)
    if path.is_file() and is_trace_file(path):
        raise ValueError(f"{path} holds a paratwin trace; the Chrome export must not overwrite it "
                         f"(write it to {path.with_name(CHROME_FALLBACK)})")
    check_replace(path, "chrome")
    return write_pieces_atomic(path, chrome_text(trace, gpus_per_node))
