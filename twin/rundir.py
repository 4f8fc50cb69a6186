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
  runs_modelled.csv  calibrate/validate runs=: each measured run, measured and predicted
  paratwin.json      which verb wrote the directory, and when (``claim``)
```

A user's files are theirs: ``claim`` refuses a directory another verb wrote, or one that
already holds files under this verb's names that paratwin did not write (``force=True``
overrides), and ``prepare`` clears only what an earlier run of the same verb left there.
"""

from __future__ import annotations

import gzip
import json
import re
import time
from collections.abc import Iterable
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
RUNS_MODELLED = "runs_modelled.csv"
OWNER = "paratwin.json"
OWNER_FORMAT = "paratwin-run"

OUTPUTS: dict[str, tuple[str, ...]] = {
    # the files each verb writes into its run directory (what ``claim`` guards)
    "simulate": (CONFIG, SUMMARY, TRACE, CHROME, REPORT),
    "execute": (CONFIG, SUMMARY, TRACE, CHROME, REPORT, SCHEDULE, SETTINGS, PROGRESS, STORE),
    "bench": (CONFIG, COLLECTIVES_CSV, KERNELS_CSV, BENCH_META, SETTINGS, PROGRESS, STORE),
    "calibrate": (CONFIG, PROFILE, FITS, MODELLED, COLLECTIVES_CSV, KERNELS_CSV, BENCH_META,
                  RUNS_MODELLED),
    "validate": ("validate.json", REPORT, RUNS_MODELLED),
}


class RunDirError(ValueError):
    """A run directory that a writer must not write into (one line: the path, why, the fix)."""


def owner(run_dir: str | Path) -> str | None:
    """The verb that wrote ``run_dir`` (its paratwin.json), None when none did."""
    path = Path(run_dir) / OWNER
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if isinstance(data, dict) and data.get("format") == OWNER_FORMAT:
        return str(data.get("verb"))
    return None


def claim(run_dir: str | Path, verb: str, force: bool = False,
          outputs: Iterable[str] | None = None) -> Path:
    """Create ``run_dir`` for ``verb``, or take it over when that is safe, and record the verb.

    Refused (RunDirError) unless ``force``: a path that is a file; a directory another verb
    wrote; a directory no paratwin verb wrote that already holds one of the verb's files
    (``outputs``, default ``OUTPUTS[verb]``). Files of other names are never touched."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"{run_dir} is a file, not a directory; give a directory for the run "
                          "(a new one is created)")
    prev = owner(run_dir)
    if not force and run_dir.is_dir():
        if prev is not None and prev != verb:
            raise RunDirError(f"{run_dir} holds a run written by `paratwin {prev}`; `paratwin "
                              f"{verb}` would replace its files: give another directory, or "
                              "force=true to write over them")
        names = OUTPUTS.get(verb, ()) if outputs is None else tuple(outputs)
        clash = sorted(n for n in names if (run_dir / n).exists()) if prev is None else []
        if clash:
            raise RunDirError(f"{run_dir} already holds {', '.join(clash)}, not written by "
                              f"`paratwin {verb}`; give another directory, or force=true to "
                              "replace those files (no other file is touched)")
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json(run_dir / OWNER, {"format": OWNER_FORMAT, "verb": verb,
                                 "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    return run_dir



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
    """The ranks' settings (run.json); a missing or damaged file says how to make it again."""
    path = Path(run_dir) / SETTINGS
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; prepare the run directory with "
                                "`paratwin execute ... launcher=torchrun` first")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RunDirError(f"{path} is not valid JSON ({err}); prepare the run directory again "
                          "with `paratwin execute ... launcher=torchrun out_dir=...`") from None
    if not isinstance(data, dict) or "task" not in data:
        raise RunDirError(f"{path} is not paratwin's run settings (no task); prepare the run "
                          "directory again with `paratwin execute ... launcher=torchrun`")
    return data


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


def prepare(run_dir: str | Path, verb: str = "execute", force: bool = False) -> Path:
    """``claim`` the run directory for ranks to run in, and clear what an earlier run of
    paratwin left there: its rank logs and error reports (logs/rankN.log, errors/rankN.json),
    trace, Chrome export, summary, progress board and store. Nothing else is removed."""
    run_dir = claim(run_dir, verb, force)
    for sub, pattern in (("logs", r"rank\d+\.log"), ("errors", r"rank\d+\.json")):
        folder = run_dir / sub
        if folder.exists() and not folder.is_dir():
            raise RunDirError(f"{folder} is a file; the ranks write their {sub} there: move it")
        folder.mkdir(exist_ok=True)
        for old in folder.iterdir():
            if old.is_file() and re.fullmatch(pattern, old.name):
                old.unlink()
    for name in (TRACE, CHROME, SUMMARY, PROGRESS, STORE):
        if (run_dir / name).is_file():
            (run_dir / name).unlink()
    return run_dir


MARKERS = {
    # what says, in a file's first 4 KiB, that paratwin wrote it and as what
    "trace": r'"format"\s*:\s*"' + TRACE_FORMAT + '"',
    "schedule": r'"format"\s*:\s*"paratwin-schedule"',
    "chrome": r'"generator"\s*:\s*"paratwin"',
    "report": r"<meta name=.generator. content=.paratwin.",
    "profile": r"(?m)^format:\s*paratwin-profile",
    "summary": r'"step_time_s"\s*:',
}


def is_kind(path: str | Path, kind: str) -> bool:
    """Whether ``path`` is a file paratwin wrote as ``kind`` (a cheap look at its head)."""
    path = Path(path)
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rt") as fh:
                head = fh.read(4096)
        else:
            with path.open("r", encoding="utf-8", errors="replace") as fh:
                head = fh.read(4096)
    except (OSError, EOFError, gzip.BadGzipFile):
        return False
    return bool(re.search(MARKERS[kind], head))


def is_trace_file(path: Path) -> bool:
    """Cheap check of a JSON file's head for the trace format marker."""
    return is_kind(path, "trace")


def check_replace(path: str | Path, kind: str, force: bool = False) -> Path:
    """``path``, safe to write a ``kind`` file to: absent, or a ``kind`` paratwin wrote
    (or ``force``); else RunDirError saying it was not overwritten and what to do."""
    path = Path(path)
    if path.is_dir():
        raise RunDirError(f"{path} is a directory; give a file path for the {kind}")
    if path.exists() and not force and not is_kind(path, kind):
        raise RunDirError(f"{path} exists and is not a paratwin {kind}; it was not overwritten: "
                          "give another path, or force=true to replace it")
    return path


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
    """Where the Chrome export goes in ``directory``: trace.json, unless a file there is not
    a paratwin Chrome export (the paratwin trace itself, or a user's), then
    chrome_trace.json; RunDirError when neither is free."""
    for name in (CHROME, CHROME_FALLBACK):
        path = Path(directory) / name
        if not path.exists() or is_kind(path, "chrome"):
            return path
    raise RunDirError(f"{directory} holds a {CHROME} and a {CHROME_FALLBACK} that paratwin did "
                      "not write; the Chrome export was not written there (move one of them)")
