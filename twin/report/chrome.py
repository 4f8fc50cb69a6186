"""The Chrome/Perfetto export of a run: ``twin.trace.chrome_trace`` plus memory counters.

Counters ("ph": "C") give Perfetto and chrome://tracing a memory track per rank: live
bytes per category (GiB), restarting at each step as the summary counts them.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from twin.files import write_text_atomic
from twin.report.memory import live_series
from twin.report.style import GIB
from twin.trace import Trace, chrome_trace

CHROME_NAME = "trace.json"
FALLBACK_NAME = "chrome_trace.json"
"""Used when trace.json in the run directory is the paratwin trace itself (never overwritten)."""


def chrome_events(trace: Trace, gpus_per_node: int | None = None) -> dict:
    """``chrome_trace`` with a memory counter per rank."""
    data = chrome_trace(trace, gpus_per_node)
    gpn = gpus_per_node or trace.meta.get("gpus_per_node") or 8
    by_rank = defaultdict(list)
    for s in trace.spans:
        if s.kind in ("alloc", "free"):
            by_rank[s.rank].append(s)
    for rank, spans in sorted(by_rank.items()):
        times, cats, values = live_series(spans)
        for t, row in zip(times, values):
            data["traceEvents"].append({"ph": "C", "name": f"memory rank {rank} (GiB)",
                                        "pid": rank // gpn, "ts": float(t),
                                        "args": {c: round(float(v) / GIB, 6) for c, v in zip(cats, row)}})
    return data


def _holds_paratwin_trace(path: Path) -> bool:
    from twin.report.rundir import is_trace_file

    return path.is_file() and is_trace_file(path)


def chrome_path(directory: Path) -> Path:
    """Where the export goes in ``directory``: trace.json, unless that is the paratwin trace."""
    path = Path(directory) / CHROME_NAME
    return Path(directory) / FALLBACK_NAME if _holds_paratwin_trace(path) else path


def write_chrome(trace: Trace, path: Path, gpus_per_node: int | None = None) -> Path:
    """Write the export atomically (compact JSON)."""
    path = Path(path)
    if _holds_paratwin_trace(path):
        raise ValueError(f"{path} holds a paratwin trace; the Chrome export must not overwrite it "
                         f"(write it to {path.with_name(FALLBACK_NAME)})")
    return write_text_atomic(path, json.dumps(chrome_events(trace, gpus_per_node),
                                              separators=(",", ":")))
