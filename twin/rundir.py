"""The run directory: its file names, and reading and writing them (twin, executor, reports).

Every verb writes into a run directory, and they read alike:

```
RUN_DIR/
  config.yaml        the resolved config (written once, by the verb)
  summary.json       the figures of the run (twin.summary.Summary)
  spans.json         the paratwin trace (twin.trace.Trace; executor: rewritten after every step)
  trace.json         its Chrome/Perfetto export (twin.chrome; chrome_trace.json when trace.json
                     is the paratwin trace itself)
  report.html        the HTML report (twin.report)
  schedule.json      every rank's program (executor runs; twin.schedule.ir.Schedule.save)
  run.json           the ranks' settings: task, steps, warmup, timeouts, backend, fault, ...
  progress.bin       the executor's progress board
  logs/rankN.log     each rank's stdout and stderr (local runs)
  errors/rankN.json  a rank's error report: type, message, traceback, phase, step, op
  collectives.csv    paratwin bench: measured collectives (+ time_s_model after calibrate)
  kernels.csv        paratwin bench: measured kernels (+ time_s_model after calibrate)
  meta.json          paratwin bench: the machine
  profile.yaml       paratwin calibrate: the fitted profile; fits.json: its residuals
  modelled.csv       paratwin calibrate: each benchmarked point, measured and modelled
```
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

from twin.files import write_json_atomic
from twin.trace import FORMAT as TRACE_FORMAT

CONFIG = "config.yaml"
SUMMARY = "summary.json"
TRACE = "spans.json"
TRACE_GZ = "spans.json.gz"
CHROME = "trace.json"
CHROME_FALLBACK = "chrome_trace.json"
REPORT = "report.html"
SCHEDULE = "schedule.json"
SETTINGS = "run.json"
PROGRESS = "progress.bin"
STORE = "store"
COLLECTIVES_CSV = "collectives.csv"
KERNELS_CSV = "kernels.csv"
BENCH_META = "meta.json"
PROFILE = "profile.yaml"
FITS = "fits.json"
MODELLED = "modelled.csv"



def write_json(path: str | Path, data, indent: int | None = 2) -> Path:
    """Write JSON atomically (a temporary file renamed into place)."""
    return write_json_atomic(path, data, indent=indent)


def read_summary(run_dir: str | Path) -> dict | None:
    """summary.json of a run directory as a dict, None when there is none."""
    path = Path(run_dir) / SUMMARY
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err}); rerun the command that wrote it") \
            from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a paratwin summary (a JSON object is expected, found "
                         f"{type(data).__name__}); rerun the command that wrote it")
    return data


def read_settings(run_dir: str | Path) -> dict:
    path = Path(run_dir) / SETTINGS
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; prepare the run directory with "
                                "`paratwin execute ... launcher=torchrun` first")
    return json.loads(path.read_text())


def log_path(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / "logs" / f"rank{rank}.log"


def error_path(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / "errors" / f"rank{rank}.json"


def read_errors(run_dir: str | Path) -> list[dict]:
    """Every rank's error report, earliest first."""
    out = []
    for p in sorted((Path(run_dir) / "errors").glob("rank*.json")):
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return sorted(out, key=lambda e: e.get("t_ns", 0))


def prepare(run_dir: str | Path) -> Path:
    """Create the run directory and clear what a previous run there left behind."""
    run_dir = Path(run_dir)
    for sub in ("logs", "errors"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
        for old in (run_dir / sub).iterdir():
            old.unlink()
    for name in (TRACE, CHROME, SUMMARY, PROGRESS, STORE):
        (run_dir / name).unlink(missing_ok=True)
    return run_dir


def is_trace_file(path: Path) -> bool:
    """Cheap check of a JSON file's head for the trace format marker."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rt") as fh:
                head = fh.read(4096)
        else:
            with path.open("r", encoding="utf-8", errors="replace") as fh:
                head = fh.read(4096)
    except (OSError, EOFError, gzip.BadGzipFile):
        return False
    return bool(re.search(r'"format"\s*:\s*"' + TRACE_FORMAT + '"', head))


def find_trace(run_dir: Path) -> Path | None:
    """spans.json, else the first JSON file in the directory that is a paratwin trace."""
    for name in (TRACE, TRACE_GZ):
        if (run_dir / name).is_file():
            return run_dir / name
    for path in sorted([*run_dir.glob("*.json"), *run_dir.glob("*.json.gz")]):
        if path.name not in (SUMMARY, REPORT, CHROME_FALLBACK) and is_trace_file(path):
            return path
    return None


def chrome_path(directory: Path) -> Path:
    """Where the Chrome export goes in ``directory``: trace.json, unless that is the
    paratwin trace itself (then chrome_trace.json)."""
    path = Path(directory) / CHROME
    if path.is_file() and is_trace_file(path):
        return Path(directory) / CHROME_FALLBACK
    return path
