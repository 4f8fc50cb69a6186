"""nccl-tests output (``all_reduce_perf`` and friends) as collective measurements.

Two forms are read: the tool's own text output (``#``-comment header, one row per size:
``size count type redop root time algbw busbw #wrong`` out-of-place then in-place, time in
microseconds; the group size from its ``#  Rank N ...`` device lines or ``nranks``), and a
CSV of it (the A100 set: ``size(B),count,type,time(ns),busbw(GB/s),...``, time in
nanoseconds, the group size in the file name, ``..._8gpu.csv``). Each size gives one row
in the bench CSV's shape (``kind, group_size, bytes, time_s_median``): the faster of the
out-of-place and in-place times, as nccl-tests users quote.
"""

from __future__ import annotations

import csv
import re
from pathlib import Path

KINDS = {"all_reduce": "all_reduce", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter",
         "alltoall": "all_to_all", "broadcast": "broadcast", "reduce": "reduce",
         "sendrecv": "sendrecv"}


class NcclTestsError(ValueError):
    """A file that is not nccl-tests output (one line: the file and what is missing)."""


def _kind(path: Path, text: str) -> str:
    name = path.name.lower()
    for key in sorted(KINDS, key=len, reverse=True):
        if key.replace("_", "") in name.replace("_", "") or f"{key}_perf" in text:
            return KINDS[key]
    raise NcclTestsError(f"{path}: cannot tell which collective it measured; name the file after "
                         "it (all_reduce_perf.txt, nccl_allreduce_8gpu.csv)")


def _ranks(path: Path, text: str) -> int:
    m = re.search(r"(\d+)\s*gpus?", path.name, re.I) or re.search(r"nranks\s*[=:]?\s*(\d+)", text)
    if m:
        return int(m.group(1))
    ranks = re.findall(r"^#\s+Rank\s+\d+\s", text, re.M)
    if ranks:
        return len(ranks)
    raise NcclTestsError(f"{path}: cannot tell the number of ranks; keep nccl-tests' '#  Rank' "
                         "lines or name the file ..._Ngpu")


def read_nccl_tests(path: str | Path) -> list[dict]:
    """The measurements of one nccl-tests output file (see the module docstring)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig", errors="replace")
    except OSError as err:
        raise NcclTestsError(f"{path}: cannot read it ({err.strerror})") from None
    kind, n = _kind(path, text), _ranks(path, text)
    rows: list[dict] = []
    first = text.lstrip().splitlines()[0] if text.strip() else ""
    if first.lower().startswith("size"):
        reader = csv.reader(text.splitlines())
        header = [h.strip().lower() for h in next(reader)]
        cols = [i for i, h in enumerate(header) if h.startswith("time")]
        if not cols:
            raise NcclTestsError(f"{path}: a CSV without time columns (header {header})")
        scale = 1e-9 if "(ns)" in header[cols[0]] else 1e-6
        for row in reader:
            try:
                t = min(float(row[i]) for i in cols) * scale
                rows.append(_row(kind, n, float(row[0]), t))
            except (ValueError, IndexError):
                continue
    else:
        for line in text.splitlines():
            parts = line.split()
            if not parts or line.lstrip().startswith("#") or not parts[0].isdigit():
                continue
            # size count type redop root | time algbw busbw #wrong | time algbw busbw #wrong
            try:
                size = float(parts[0])
                times = [float(parts[i]) for i in (5, 9) if i < len(parts)]
                t = min(times) * 1e-6
            except (ValueError, IndexError):
                continue
            rows.append(_row(kind, n, size, t))
    rows = [r for r in rows if r["time_s_median"] > 0 and r["bytes"] > 0]
    if not rows:
        raise NcclTestsError(f"{path}: no measurement rows found; give nccl-tests' output "
                             "(all_reduce_perf ... > FILE) or its CSV")
    return rows


def _row(kind: str, n: int, size: float, t: float) -> dict:
    return {"kind": kind, "group_size": n, "bytes": size, "time_s_median": t,
            "time_s_p10": t, "time_s_p90": t, "backend": "nccl"}
