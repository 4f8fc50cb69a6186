"""The config edge: where conf/ is, Hydra/OmegaConf nodes in, plain validated specs and profiles out."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from twin.cost import CostModel, default_cost_model
from twin.spec import (
    ClusterSpec,
    ConfigError,
    ConfigWarning,
    Job,
    ModelSpec,
    ParallelPlan,
    build_job,
)
from twin.spec.io import cluster_from_dict

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
"""The Hydra config tree (presets, profiles): the one place that says where it is."""

SPECS = {"model": ModelSpec, "cluster": ClusterSpec, "parallel": ParallelPlan}


def field_defaults(cls: type) -> dict:
    """The declared defaults of a spec dataclass, recursively, as a plain dict.

    Presets start from these (``defaults: [schema, _self_]``) so every field exists in
    the composed config and can be overridden as ``parallel.tp=8``. Derived fields
    (ModelSpec.norm etc.) keep their ``None`` here and resolve when the spec is built.
    """
    out: dict = {}
    for f in dataclasses.fields(cls):
        if f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
            out[f.name] = field_defaults(type(value)) if dataclasses.is_dataclass(value) \
                else value
        else:
            out[f.name] = f.default
    return out


def register_schemas() -> None:
    """Store each spec's defaults as ``GROUP/schema`` in Hydra's ConfigStore."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for group, cls in SPECS.items():
        store.store(group=group, name="schema", node=field_defaults(cls))


def to_spec(cls: type, node: Any, group: str) -> Any:
    """Type-check ``node`` against dataclass ``cls`` and build it (validation included)."""
    schema = _writable(OmegaConf.structured(cls))
    try:
        merged = OmegaConf.merge(schema, node if node is not None else {})
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or ""
        msg = str(err).splitlines()[0]
        raise ConfigError(f"{group}{'.' + key if key else ''}: {msg}") from None


def _writable(node: DictConfig) -> DictConfig:
    """Clear the read-only flag OmegaConf puts on every frozen dataclass node, recursively,
    so the schema can take the composed values (the dataclasses themselves stay frozen)."""
    node._set_flag("readonly", None)
    for key in node.keys():
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            _writable(child)
    return node


def job_from_cfg(cfg: DictConfig) -> Job:
    """Build the three specs from a composed config and check them against each other."""
    specs = {name: to_spec(cls, cfg.get(name), name) for name, cls in SPECS.items()}
    csv = specs["parallel"].pp_schedule_csv
    if csv is not None and not Path(csv).is_absolute():  # ranks and run.json read it anywhere
        with warnings.catch_warnings():  # the plan warned once already
            warnings.simplefilter("ignore")
            specs["parallel"] = dataclasses.replace(specs["parallel"],
                                                    pp_schedule_csv=str(Path(csv).resolve()))
    return build_job(**specs)


def load_profile(name, cluster) -> CostModel:
    """A calibration profile by name (conf/profiles/NAME.yaml) or path; None: the published
    defaults; 'auto': conf/profiles/CLUSTER.yaml when it was fitted on this cluster, else the
    defaults.

    ConfigError for a directory, a missing file or one that is not a valid profile; a
    warning when the profile was fitted on another cluster than ``cluster``."""
    if name is None:
        return default_cost_model(cluster)
    if str(name) == "auto":  # the cluster's own profile when one was fitted for it
        own = CONF_DIR / "profiles" / f"{cluster.name}.yaml"
        if own.is_file():
            cost = CostModel.load(own)
            if cost.cluster_mismatch(cluster) is None:
                return cost
        return default_cost_model(cluster)
    text = str(name)
    profiles = CONF_DIR / "profiles"
    bare = not Path(text).suffix and "/" not in text and "\\" not in text
    path = profiles / f"{text}.yaml" if bare and (profiles / f"{text}.yaml").is_file() \
        else Path(text)
    if path.is_dir():
        inside = path / "profile.yaml"
        hint = f"calibration={inside}" if inside.is_file() else \
            "a profile file: a name in conf/profiles/ or a path to a .yaml"
        raise ConfigError(f"calibration={text} is a directory, not a profile; give {hint}")
    if not path.is_file():
        have = sorted(p.stem for p in profiles.glob("*.yaml"))
        where = profiles / f"{text}.yaml" if bare else path
        raise ConfigError(f"calibration={text}: no profile at {where}; available: "
                          f"{', '.join(have) or 'none yet (run paratwin calibrate)'}")
    try:
        cost = CostModel.load(path)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    mismatch = cost.cluster_mismatch(cluster)
    if mismatch:
        warnings.warn(f"calibration={text}: {mismatch}", ConfigWarning, stacklevel=2)
    return cost


def preset_cluster(name: str) -> ClusterSpec:
    """A cluster preset of conf/cluster/ by name (its fields over the spec's defaults)."""
    import yaml

    path = CONF_DIR / "cluster" / f"{name}.yaml"
    if not path.is_file():
        names = sorted(p.stem for p in (CONF_DIR / "cluster").glob("*.yaml"))
        raise ConfigError(f"cluster={name} is not a preset; choose one of {', '.join(names)}")
    try:
        return cluster_from_dict(yaml.safe_load(path.read_text()) or {})
    except Exception as err:  # noqa: BLE001 - a broken preset file: say which
        raise ConfigError(f"{path} is not a valid cluster preset ({err})") from None
