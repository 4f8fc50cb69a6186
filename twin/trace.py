"""Trace: the spans of a run (twin or executor), one schema for both, and its files.

A span is one op of one rank in one step, identified by (rank, step, op). Times are in
microseconds from the start of the run (the Chrome-trace unit). Memory ops are spans of
zero length whose ``bytes`` and ``category`` say what was allocated or freed.

File format (``trace.json`` or ``.json.gz``): {"format": "paratwin-trace", "version": 1,
"meta": {...}, "columns": [...], "spans": [[...], ...]}: columnar, so a 200,000-span
trace stays small and quick to load.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import astuple, dataclass, field, fields
from pathlib import Path

from twin.files import write_text_atomic

FORMAT = "paratwin-trace"
VERSION = 1


@dataclass(slots=True)
class Span:
    """One op executed (or simulated) on one rank."""

    rank: int
    step: int
    op: str
    """The op's name: its stable id in the schedule (twin and executor share it)."""
    kind: str
    stream: str
    start_us: float
    end_us: float
    phase: str = ""
    layer: int = -1
    mb: int = -1
    group: str = ""
    """Collective/p2p group name (dp, tp, pp, ...), '' for compute and memory."""
    bytes: float = 0.0
    flops: float = 0.0
    category: str = ""
    """Memory category of alloc/free spans."""
    peer: int = -1
    """The other rank of a send or recv."""
    tag: str = ""
    """The tag pairing a send with its recv."""

    @property
    def dur_us(self) -> float:
        return self.end_us - self.start_us


COLUMNS = [f.name for f in fields(Span)]


@dataclass
class Trace:
    """Spans plus metadata: source (twin|executor), job, world size, steps, and more."""

    spans: list[Span] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    def by_rank(self) -> dict[int, list[Span]]:
        out: dict[int, list[Span]] = {}
        for s in self.spans:
            out.setdefault(s.rank, []).append(s)
        return out

    def steps(self) -> list[int]:
        return sorted({s.step for s in self.spans})

    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "meta": self.meta, "columns": COLUMNS,
                "spans": [list(astuple(s)) for s in self.spans]}

    def save(self, path: str | Path) -> Path:
        """Write atomically (a temporary file renamed into place); ``.gz`` compresses."""
        path = Path(path)
        return write_text_atomic(path, json.dumps(self.to_dict(), separators=(",", ":")),
                                 compress=path.suffix == ".gz")

    @classmethod
    def from_dict(cls, data: dict, where: str = "data") -> Trace:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{where} is not a paratwin trace (no 'format: {FORMAT}'); "
                             "give the spans.json written by simulate or execute")
        if data.get("version") != VERSION:
            raise ValueError(f"{where}: trace version {data.get('version')} is not supported "
                             f"(this paratwin reads version {VERSION})")
        cols = data["columns"]
        if cols != COLUMNS:
            idx = [cols.index(c) if c in cols else None for c in COLUMNS]
            defaults = Span(0, 0, "", "", "", 0.0, 0.0)
            rows = [Span(*[r[i] if i is not None else getattr(defaults, c)
                           for i, c in zip(idx, COLUMNS)]) for r in data["spans"]]
        else:
            rows = [Span(*r) for r in data["spans"]]
        return cls(spans=rows, meta=data.get("meta", {}))

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        """Read a trace file; anything else gets an error naming the file and the fix."""
        path = Path(path)
        try:
            if path.suffix == ".gz":
                with gzip.open(path, "rt") as fh:
                    data = json.load(fh)
            else:
                data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError, OSError, EOFError) as err:
            raise ValueError(f"{path} is not a paratwin trace ({type(err).__name__}: {err})") \
                from None
        return cls.from_dict(data, str(path))


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
        if s.kind in ("alloc", "free"):
            continue
        free = ends.setdefault((s.rank, s.stream), [])
        k = next((k for k, e in enumerate(free) if e <= s.start_us), len(free))
        if k == len(free):
            free.append(s.end_us)
        else:
            free[k] = s.end_us
        slot[i] = k
    return slot


def chrome_trace(trace: Trace, gpus_per_node: int | None = None) -> dict:
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
        if s.kind in ("alloc", "free"):
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
    return {"traceEvents": events, "displayTimeUnit": "ms"}
