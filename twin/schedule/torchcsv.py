"""Pipeline action tables in torch.distributed.pipelining's CSV format: write, read, check.

One row per pipeline rank, one cell per action, ``{chunk}{F|B|I|W}{micro-batch}`` (``0F0``,
``3I1``, ``5W2``); an overlapped forward and backward pair (DualPipe's F&B) is
``(0F3;7B1)OVERLAP_F_B``; an empty cell is an idle slot. This is what torch 2.13's
``_PipelineScheduleRuntime._load_csv`` reads (format ``compute_only``; ``_Action.from_str``)
and ``_dump_csv`` writes. A table read here is checked as torch's ``_validate_schedule``
does (every chunk on one rank, F before B or I before W) and more: every (micro-batch,
chunk) once forward and once backward, and no deadlock (``pipeline.run_tables``), or one
line names what is wrong (the first blocked action of each stuck rank).
"""

from __future__ import annotations

import csv
import io
import os
import re
from collections import Counter
from typing import NamedTuple

from twin.schedule.pipeline import Action, Overlapped, TableDeadlock, run_tables
from twin.spec.errors import ConfigError

_ACTION = re.compile(r"^(\d+)(F|B|I|W)(\d+)$")
_PAIR = re.compile(r"^\((.*);(.*)\)OVERLAP_F_B$")


def action_str(a: Action) -> str:
    """torch's ``_Action`` string of a compute action: stage (our chunk), type, micro-batch."""
    return f"{a.chunk}{a.phase}{a.mb}"


def row_cells(order: list[Action]) -> list[str]:
    """One rank's cells; an overlapped forward and the backward after it share one cell."""
    cells, i = [], 0
    while i < len(order):
        a = order[i]
        if a.overlap and i + 1 < len(order):
            cells.append(f"({action_str(a)};{action_str(order[i + 1])})OVERLAP_F_B")
            i += 2
        else:
            cells.append(action_str(a))
            i += 1
    return cells


def format_csv(orders: list[list[Action]]) -> str:
    """The tables of every rank (row r = pipeline rank r) as torch's CSV text."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for order in orders:
        writer.writerow(row_cells(order))
    return out.getvalue()


def _parse_cell(cell: str, where: str) -> list[Action]:
    cell = cell.strip()
    if not cell:
        return []
    pair = _PAIR.match(cell)
    if pair:
        f, b = (_parse_cell(x, where) for x in pair.groups())
        if len(f) != 1 or len(b) != 1 or f[0].phase != "F" or b[0].phase not in "BI":
            raise ConfigError(f"{where}: {cell!r} must pair one forward with one backward, "
                              "e.g. (0F3;7B1)OVERLAP_F_B")
        return [Overlapped(*f[0]), b[0]]
    m = _ACTION.match(cell)
    if not m:
        raise ConfigError(f"{where}: {cell!r} is not a compute action; write STAGE TYPE "
                          "MICROBATCH with TYPE in F, B, I, W (e.g. 0F0, 1I0, 0W0)")
    return [Action(m.group(2), int(m.group(3)), int(m.group(1)))]


def parse_csv(text: str, source: str = "table") -> list[list[Action]]:
    """Every rank's actions from torch's CSV text (ConfigError naming the row and cell)."""
    rows = list(csv.reader(io.StringIO(text)))
    while rows and not any(c.strip() for c in rows[-1]):
        rows.pop()
    return [[a for k, cell in enumerate(row)
             for a in _parse_cell(cell, f"{source} row {r} cell {k}")]
            for r, row in enumerate(rows)]


class Table(NamedTuple):
    """A checked table: each rank's actions and the rank of each chunk."""

    orders: list[list[Action]]
    placement: tuple[int, ...]
    microbatches: int


def check_orders(orders: list[list[Action]], pp: int, n_chunks: int,
                 source: str = "table") -> Table:
    """Check a table for ``pp`` ranks and ``n_chunks`` chunks; raise ConfigError in one line."""
    if len(orders) != pp:
        raise ConfigError(f"{source} has {len(orders)} rows but parallel.pp={pp}; give one row "
                          "per pipeline rank")
    where: dict[int, int] = {}
    for r, order in enumerate(orders):
        for a in order:
            if not 0 <= a.chunk < n_chunks:
                raise ConfigError(f"{source} row {r}: {action_str(a)} names stage {a.chunk} but "
                                  f"pp * pp_virtual_stages = {n_chunks}; number stages 0.."
                                  f"{n_chunks - 1} or set parallel.pp_virtual_stages")
            if where.setdefault(a.chunk, r) != r:
                raise ConfigError(f"{source}: stage {a.chunk} runs on rows {where[a.chunk]} and "
                                  f"{r}; each stage belongs to one pipeline rank")
    missing = [c for c in range(n_chunks) if c not in where]
    if missing:
        raise ConfigError(f"{source} never runs stage {missing[0]} of {n_chunks} "
                          f"(pp * pp_virtual_stages); add its actions or set "
                          "parallel.pp_virtual_stages")
    count = Counter((a.phase, a.mb, a.chunk) for o in orders for a in o)
    mbs = 1 + max(a.mb for o in orders for a in o)
    for c in range(n_chunks):
        for mb in range(mbs):
            bwd = tuple(count[(x, mb, c)] for x in "BIW")
            if count[("F", mb, c)] != 1 or bwd not in ((1, 0, 0), (0, 1, 1)):
                raise ConfigError(f"{source}: micro-batch {mb} of stage {c} has "
                                  f"{count[('F', mb, c)]} F, {bwd[0]} B, {bwd[1]} I, {bwd[2]} W; "
                                  "every micro-batch needs one F and one B (or one I and one W)")
    for r, order in enumerate(orders):
        seen: set[tuple[str, int, int]] = set()
        for a in order:
            need = {"B": "F", "I": "F", "W": "I"}.get(a.phase)
            if need and (need, a.mb, a.chunk) not in seen:
                raise ConfigError(f"{source} row {r}: {action_str(a)} comes before "
                                  f"{a.chunk}{need}{a.mb}; put it after")
            seen.add((a.phase, a.mb, a.chunk))
    try:
        run_tables(orders, 1)
    except TableDeadlock as err:
        s, k, a = err.blocked[0]
        also = ", ".join(f"row {r} at {action_str(b)}" for r, _, b in err.blocked[1:])
        raise ConfigError(f"{source} deadlocks: row {s} blocks at action {k} ({action_str(a)}), "
                          "waiting for an input that never comes" +
                          (f"; also blocked: {also}" if also else "")) from None
    return Table(orders, tuple(where[c] for c in range(n_chunks)), mbs)


_CACHE: dict[tuple, Table] = {}


def load_table(path: str, pp: int, n_chunks: int) -> Table:
    """Read and check the CSV at ``path`` (cached while the file is unchanged)."""
    try:
        st = os.stat(path)
        key = (os.path.abspath(path), st.st_mtime_ns, st.st_size, pp, n_chunks)
        if key not in _CACHE:
            with open(path, newline="") as f:
                text = f.read()
            src = f"parallel.pp_schedule_csv={path}"
            _CACHE[key] = check_orders(parse_csv(text, src), pp, n_chunks, src)
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"parallel.pp_schedule_csv={path}: cannot read it "
                          f"({getattr(err, 'strerror', None) or err}); give a CSV file") from None
    return _CACHE[key]
