"""Measured runs as jobs: each row of a runs file composed over the presets it names.

The library reads and checks the file (``twin.calibrate.runs``); here each row's presets
(``model``, ``cluster``, ``parallel`` columns or ``set``, else the base the caller gives)
are composed once per combination with Hydra, the row's dotted keys merged on top, and the
job built and checked. Every row that cannot become a job is named with its problem, all
at once, before anything is fitted or written.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from paratwin.config import CONF_DIR
from twin.calibrate.runs import PRESETS, ColumnMap, MeasuredRun, RunsFileError, read_runs
from twin.spec import ConfigError, Job
from twin.spec.io import job_from_dict


@dataclass(frozen=True)
class RunJob:
    """A measured run and the job it describes."""

    run: MeasuredRun
    job: Job


def column_map(name: str | None) -> ColumnMap | None:
    """A column map by name (conf/column_maps/NAME.yaml) or path; None: the file's own columns."""
    if not name:
        return None
    path = Path(str(name))
    if not path.suffix:
        path = CONF_DIR / "column_maps" / f"{name}.yaml"
    if not path.is_file():
        have = sorted(p.stem for p in (CONF_DIR / "column_maps").glob("*.yaml"))
        raise ConfigError(f"runs_columns={name}: no column map at {path}; available: "
                          f"{', '.join(have) or 'none'}")
    return ColumnMap.load(path)


def _base(choices: tuple[tuple[str, str], ...]):
    """The presets composed as `paratwin simulate` would (inside a verb: its Hydra)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from paratwin.config import register_schemas

    overrides = [f"{k}={v}" for k, v in choices]
    if GlobalHydra.instance().is_initialized():
        return compose(config_name="simulate", overrides=overrides)
    register_schemas()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="simulate", overrides=overrides)


def jobs_from_runs(path: str | Path, columns: ColumnMap | None,
                   base: dict[str, str] | None = None, limit_errors: int = 5) -> list[RunJob]:
    """The job of every row of the runs file ``path``; ConfigError naming the bad rows."""
    try:
        runs = read_runs(path, columns)
    except RunsFileError as err:
        raise ConfigError(str(err)) from None
    composed: dict[tuple, object] = {}
    out: list[RunJob] = []
    problems: list[str] = []
    for run in runs:
        choice = {**(base or {}), **{k: str(v) for k, v in run.overrides.items() if k in PRESETS}}
        key = tuple(sorted(choice.items()))
        if key not in composed:
            try:
                cfg = _base(key)
                composed[key] = {n: OmegaConf.to_container(cfg[n], resolve=True) for n in PRESETS}
            except Exception as err:  # noqa: BLE001 - a preset that does not exist: name the row
                problems.append(f"{path} {run.label}: {str(err).splitlines()[0]}")
                continue
        spec = copy.deepcopy(composed[key])
        try:
            for k, v in run.overrides.items():
                if k in PRESETS:
                    continue
                section, _, field = k.partition(".")
                node = spec[section]
                *path, leaf = field.split(".")
                for part in path:
                    node = node.setdefault(part, {})
                node[leaf] = v
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a fill/drain pipeline is a legal measured run
                out.append(RunJob(run, job_from_dict(spec)))
        except (ConfigError, ValueError, TypeError) as err:
            problems.append(f"{path} {run.label}: {err}")
    if problems:
        more = f" (and {len(problems) - limit_errors} more rows)" if len(problems) > limit_errors else ""
        raise ConfigError("; ".join(problems[:limit_errors]) + more)
    return out
