"""The config edge: Hydra/OmegaConf nodes in, plain validated specs out."""

from __future__ import annotations

import dataclasses
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from twin.spec import ClusterSpec, ConfigError, Job, ModelSpec, ParallelPlan, build_job

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
    return build_job(**specs)
