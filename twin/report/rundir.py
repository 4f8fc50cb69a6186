"""Run directories as the report reads them: summary, trace, config, benchmark CSVs, profile.

A run directory (written by ``paratwin simulate``, ``execute`` or ``bench``) holds any of:
``summary.json``; the paratwin trace (``spans.json``, else any ``*.json``/``*.json.gz`` whose
content says ``format: paratwin-trace``); ``config.yaml`` (model, cluster, parallel, ...);
benchmark CSVs; a calibration profile YAML. A directory with none of these but with run
directories inside (a Hydra ``-m`` sweep) stands for those.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from twin.rundir import CONFIG, RUNS_MODELLED, SUMMARY, find_trace, read_summary
from twin.spec import ClusterSpec, Job
from twin.spec.io import cluster_from_dict, job_from_dict
from twin.trace import Trace
from twin.vocab import MEMORY_KINDS


@dataclass
class Run:
    """What one run directory holds (any part may be missing)."""

    path: Path
    summary: dict | None = None
    trace: Trace | None = None
    trace_path: Path | None = None
    config: dict | None = None
    job: Job | None = None
    bench_csvs: list[Path] = field(default_factory=list)
    profile_path: Path | None = None
    modelled_path: Path | None = None
    """paratwin calibrate's measured-vs-modelled table (modelled.csv)."""
    summary_derived: bool = False
    """The summary was computed from the trace (no summary.json), by ``load``'s summarizer."""
    cluster: ClusterSpec | None = None
    """The job's cluster, or the config's cluster node alone (bench directories)."""

    @property
    def name(self) -> str:
        return self.path.name or str(self.path)

    @property
    def source(self) -> str:
        """twin, executor, or what the files say."""
        meta = self.trace.meta if self.trace else {}
        return str(meta.get("source") or (self.summary or {}).get("source") or "run")

    @property
    def world_size(self) -> int | None:
        if self.job is not None:
            return self.job.grid.world_size
        ws = (self.summary or {}).get("world_size")
        return int(ws) if ws else None

    @property
    def hbm_bytes(self) -> float | None:
        return self.job.cluster.hbm_bytes if self.job is not None else None

    def job_key(self) -> str | None:
        """Identity of the schedule (model, cluster, plan): runs with equal keys can overlay."""
        if self.job is None:
            return None
        from twin.spec.io import job_to_dict

        return json.dumps(job_to_dict(self.job), sort_keys=True, default=str)


def csv_kind(path: Path) -> str | None:
    """'collective', 'kernel', 'modelled' (paratwin calibrate's modelled.csv), or None for a
    CSV that is not a benchmark table."""
    try:
        with path.open(newline="") as fh:
            header = next(csv.reader(fh), [])
    except (OSError, UnicodeDecodeError):
        return None
    cols = {c.strip() for c in header}
    if not {"kind", "time_s_median"} <= cols:
        return None
    if "time_s_model" in cols:
        return "modelled"
    if "group_size" in cols and "bytes" in cols:
        return "collective"
    if "flops" in cols:
        return "kernel"
    return None


def _find_profile(run_dir: Path) -> Path | None:
    for path in sorted([*run_dir.glob("*.yaml"), *run_dir.glob("*.yml")]):
        if path.name == CONFIG:
            continue
        try:
            head = path.read_text(errors="replace")[:2048]
        except OSError:
            continue
        if re.search(r"^format:\s*paratwin-profile", head, re.M):
            return path
    return None


def cluster_from_config(c: dict) -> ClusterSpec | None:
    """A ClusterSpec from a config's ``cluster`` node; None when it cannot be built."""
    try:
        return cluster_from_dict(c)
    except Exception:  # noqa: BLE001 - a malformed cluster: none, the report degrades
        return None


def job_from_config(cfg: dict) -> Job | None:
    """The job of a resolved config or a trace's ``meta.job``; None when it cannot be built
    (the report then leaves out what needs it, rather than failing)."""
    try:
        return job_from_dict(cfg)
    except Exception:  # noqa: BLE001 - any malformed config: no job, the report degrades
        return None


def is_run_dir(path: Path) -> bool:
    return (path / SUMMARY).is_file() or find_trace(path) is not None or \
        any(csv_kind(p) for p in path.glob("*.csv")) or (path / RUNS_MODELLED).is_file()


def expand(paths: list[str | Path]) -> list[Path]:
    """The run directories named by ``paths``: each itself, or, for a sweep directory that is
    not a run directory, the run directories inside it (in numeric order: 0, 1, ..., 10)."""
    out: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"run directory {path} does not exist; give directories "
                                    "written by `paratwin simulate`, `execute` or `bench`")
        if path.is_file():
            raise NotADirectoryError(f"{path} is a file; give the run directory that holds it "
                                     f"({path.parent})")
        if is_run_dir(path):
            out.append(path)
            continue
        inner = sorted((p for p in path.iterdir() if p.is_dir() and is_run_dir(p)),
                       key=lambda p: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)])
        if not inner:
            raise FileNotFoundError(
                f"{path} holds no paratwin trace (spans.json), summary.json or benchmark CSV, "
                "nor run directories inside; make one with `paratwin simulate out_dir=DIR` "
                "(or execute / bench) and give that directory")
        out.extend(inner)
    return out


Summarizer = Callable[[Trace, Job], Mapping]


def load(path: str | Path, summarize: Summarizer | None = None, trace: Trace | None = None) -> Run:
    """Read one run directory (see the module docstring). A directory with a trace but no
    summary.json gets ``summarize(trace, job)`` when a summarizer is given (the CLI passes
    ``twin.metrics.summarize``); the report itself never computes one. ``trace``: the
    directory's trace as its writer holds it (``Trace.as_saved``), not read again."""
    path = Path(path)
    run = Run(path=path)
    run.summary = read_summary(path)
    run.trace_path = find_trace(path)
    if run.trace_path is not None:
        run.trace = trace if trace is not None else Trace.load(run.trace_path)
    if (path / CONFIG).is_file():
        try:
            run.config = yaml.safe_load((path / CONFIG).read_text()) or {}
        except yaml.YAMLError:
            run.config = None
    for cfg in ((run.trace.meta.get("job") if run.trace else None), run.config):
        if isinstance(cfg, dict) and {"model", "cluster", "parallel"} <= set(cfg):
            run.job = job_from_config(cfg)
            if run.job is not None:
                break
    run.cluster = run.job.cluster if run.job is not None else (
        cluster_from_config(run.config["cluster"]) if isinstance(run.config, dict) and
        isinstance(run.config.get("cluster"), dict) else None)
    if summarize is not None and run.summary is None and run.trace is not None and \
            run.job is not None and any(s.kind not in MEMORY_KINDS for s in run.trace.spans):
        run.summary = summarize(run.trace, run.job)
        run.summary_derived = True
    kinds = {p: csv_kind(p) for p in sorted(path.glob("*.csv"))}
    run.bench_csvs = [p for p, k in kinds.items() if k in ("collective", "kernel")]
    run.modelled_path = next((p for p, k in kinds.items() if k == "modelled"), None)
    run.profile_path = _find_profile(path)
    if run.summary is None and run.trace is None and not run.bench_csvs and \
            run.modelled_path is None and not (path / RUNS_MODELLED).is_file():
        raise FileNotFoundError(
            f"{path} holds no paratwin trace (spans.json), summary.json or benchmark CSV; "
            "make one with `paratwin simulate out_dir=DIR` (or execute / bench)")
    return run

