"""Shared fixtures of the executor tests."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from paratwin.config import CONF_DIR, register_schemas


@pytest.fixture(scope="module")
def execute_cfg():
    """Compose `paratwin execute` configs in this process (the verb's Hydra app does the same)."""
    register_schemas()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield lambda *overrides: compose(config_name="execute", overrides=list(overrides))
    GlobalHydra.instance().clear()
