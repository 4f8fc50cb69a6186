"""Bench output: the stable CSV columns, quantiles, and the machine's metadata.

The calibration issue fits the twin's cost model to these files, so the columns are a
contract: add columns at the end, never rename or reorder them.
"""

from __future__ import annotations

import csv
import datetime
import os
import platform
import socket
from pathlib import Path

COLLECTIVE_COLUMNS = ["kind", "group_size", "bytes", "dtype", "time_s_median", "time_s_p10",
                      "time_s_p90", "algbw_GBps", "busbw_GBps", "repeats", "backend"]
KERNEL_COLUMNS = ["kind", "dtype", "shape", "flops", "bytes", "time_s_median", "time_s_p10",
                  "time_s_p90", "repeats", "tflops", "GBps", "device", "host_s_median"]


def quantile(sorted_values: list[float], p: float) -> float:
    """Nearest-rank quantile of sorted values (as twin.metrics does for step times)."""
    n = len(sorted_values)
    return sorted_values[min(n - 1, max(0, round(p * (n - 1))))]


def spread(times: list[float]) -> dict:
    """Median, p10 and p90 of repeated timings (seconds)."""
    t = sorted(times)
    return {"time_s_median": quantile(t, 0.5), "time_s_p10": quantile(t, 0.1),
            "time_s_p90": quantile(t, 0.9), "repeats": len(t)}


class CsvWriter:
    """Rows appended and flushed one at a time, so an interrupted sweep keeps its rows."""

    def __init__(self, path: str | Path, columns: list[str]):
        self.path = Path(path)
        self.columns = columns
        with open(self.path, "w", newline="") as fh:
            csv.writer(fh).writerow(columns)

    def row(self, values: dict) -> None:
        missing = [c for c in self.columns if c not in values]
        if missing:
            raise KeyError(f"bench row lacks columns {missing}")
        with open(self.path, "a", newline="") as fh:
            csv.writer(fh).writerow([_fmt(values[c]) for c in self.columns])


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_meta(backend: str, world_size: int, threads: int) -> dict:
    """Host, CPU, GPU, torch version, backend, world size and date of a bench run."""
    import torch

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] \
        if torch.cuda.is_available() else []
    return {"host": socket.gethostname(), "cpu": cpu_model(), "cpu_count": os.cpu_count(),
            "gpus": gpus, "torch_version": torch.__version__,
            "cuda_version": torch.version.cuda, "python": platform.python_version(),
            "backend": backend, "world_size": world_size, "threads_per_rank": threads,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
