"""The run directory: what the launcher writes for the ranks, and what the ranks write back.

```
RUN_DIR/
  config.yaml     the resolved Hydra config (written once, by the launcher)
  schedule.json   every rank's program (twin.schedule.ir.Schedule.save)
  run.json        the ranks' settings: task, steps, warmup, timeouts, backend, fault, ...
  progress.bin    the progress board (progress.py)
  logs/rankN.log  each rank's stdout and stderr (local runs)
  errors/rankN.json  a rank's error report: type, message, traceback, phase, step, op
  spans.json      the paratwin trace of the measured steps (rewritten after every completed step)
  trace.json      its Chrome/Perfetto export (twin.trace.chrome_trace; after the last step)
  summary.json    twin.metrics.summarize of the trace plus executor fields (idem)

The same names as `paratwin simulate` writes, so twin and executor run directories read alike.
```
"""

from __future__ import annotations

import json
from pathlib import Path

from twin.files import write_json_atomic

CONFIG = "config.yaml"
SCHEDULE = "schedule.json"
SETTINGS = "run.json"
PROGRESS = "progress.bin"
TRACE = "spans.json"
CHROME = "trace.json"
SUMMARY = "summary.json"


def write_json(path: str | Path, data, indent: int | None = 2) -> Path:
    """Write JSON atomically (twin.files: a temporary file renamed into place)."""
    return write_json_atomic(path, data, indent=indent)


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
    for name in (TRACE, CHROME, SUMMARY, PROGRESS, "store"):
        (run_dir / name).unlink(missing_ok=True)
    return run_dir
