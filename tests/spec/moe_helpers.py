"""Model presets of conf/model/ read as plain specs (no Hydra): for the MoE tests."""

from __future__ import annotations

import yaml

from paratwin.config import CONF_DIR
from twin.spec import ModelSpec


def preset_model(name: str, **overrides) -> ModelSpec:
    """conf/model/NAME.yaml as a ModelSpec, with field overrides."""
    d = yaml.safe_load((CONF_DIR / "model" / f"{name}.yaml").read_text())
    d.pop("defaults", None)
    d.update(overrides)
    return ModelSpec(**d)
