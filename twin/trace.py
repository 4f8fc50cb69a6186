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
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING

from twin.files import write_pieces_atomic

if TYPE_CHECKING:
    from twin.schedule.ir import Op

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

    @classmethod
    def of(cls, op: Op, rank: int, step: int, start_us: float, end_us: float) -> Span:
        """The span of ``op`` run on ``rank`` in ``step`` (twin and executor alike): the op's
        name, kind, stream and labels; its group only for collectives and p2p."""
        comm = op.is_collective or op.is_p2p
        return cls(rank, step, op.name, op.kind, op.stream, start_us, end_us, op.phase,
                   op.layer, op.mb, op.group_name if comm else "", op.bytes, op.flops,
                   op.category, op.peer, op.tag)


COLUMNS = [f.name for f in fields(Span)]
_ROW = attrgetter(*COLUMNS)
CHUNK = 20_000
"""Spans written per JSON chunk: ``save`` never holds the trace's text whole."""


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
                "spans": [list(_ROW(s)) for s in self.spans]}

    def save(self, path: str | Path) -> Path:
        """Write atomically (twin.files.write_pieces_atomic); ``.gz`` compresses. The spans
        are written a chunk at a time (the same bytes as ``json.dumps(to_dict())`` compact),
        so the file's text is never held whole beside the spans."""
        path = Path(path)
        return write_pieces_atomic(path, self._pieces(), compress=path.suffix == ".gz")

    def _pieces(self) -> Iterator[str]:
        head = json.dumps({"format": FORMAT, "version": VERSION, "meta": self.meta,
                           "columns": COLUMNS}, separators=(",", ":"))
        yield head[:-1] + ',"spans":['
        spans = self.spans
        for k in range(0, len(spans), CHUNK):
            rows = json.dumps([_ROW(s) for s in spans[k:k + CHUNK]], separators=(",", ":"))
            yield ("," if k else "") + rows[1:-1]
        yield "]}"

    def as_saved(self) -> Trace:
        """This trace as ``load`` reads it back from its saved file (the metadata through
        JSON: tuples become lists), sharing the spans: what a writer hands its report
        instead of reading the file it has just written."""
        return Trace(self.spans, json.loads(json.dumps(self.meta)))

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
