"""benchmarks/gpu_calibration.py's plan holds together before a GPU lease is spent on it: every
`paratwin` step composes (Hydra) and builds its job and settings, every script step parses its
arguments, and the outputs land where the analyses read them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from benchmarks import gpu_calibration as gc
from paratwin.config import CONF_DIR, job_from_cfg, register_schemas
from paratwin.verbs.bench import bench_settings
from paratwin.verbs.execute import settings_from_cfg
from twin.schedule.builder import build_schedule


@pytest.fixture
def composed():
    register_schemas()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield lambda verb, overrides: compose(config_name=verb, overrides=list(overrides))
    GlobalHydra.instance().clear()


@pytest.mark.parametrize("gpus", [1, 2])
def test_every_step_composes_and_builds(gpus, composed, tmp_path):
    steps = gc.plan(tmp_path, gpus, quick=False, cluster="dgx_h200")
    assert len(steps) == (7 if gpus == 1 else 10)
    for title, cmd in steps:
        if cmd[:3] == gc.PARATWIN:
            verb, overrides = cmd[3], cmd[4:]
            cfg = composed(verb, overrides)
            if verb == "bench":
                settings = bench_settings(cfg)
                assert settings["kernels"]["gemm"] and all(len(g) == 3 for g in settings["kernels"]["gemm"])
            elif verb == "execute":
                settings_from_cfg(cfg)
                job = job_from_cfg(cfg)
                assert job.grid.world_size == gpus if "fsdp" in title.lower() else 1
                assert build_schedule(job).program(0).ops
            assert str(tmp_path) in cfg.out_dir
        else:  # a script: its arguments parse
            script = Path(cmd[1])
            assert script.parent.name == "benchmarks" and script.is_file()


@pytest.mark.parametrize("script", ["torch_train_gpu.py", "gemm_sustained.py", "replay_host.py"])
def test_script_steps_take_their_arguments(script, tmp_path):
    """Each script parses the step's arguments, then refuses to run without a GPU (exit 2)."""
    steps = gc.plan(tmp_path, 1, quick=True, cluster="dgx_h200")
    cmd = next(c for _, c in steps if c[1].endswith(script))
    res = subprocess.run([sys.executable, *cmd[1:]], capture_output=True, text=True, timeout=120,
                         cwd=Path(gc.ROOT), env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert res.returncode == 2 and "no CUDA device" in res.stderr, res.stderr


def test_the_gpu_name_picks_the_cluster():
    assert gc.cluster_for("NVIDIA H200") == "dgx_h200"
    assert gc.cluster_for("NVIDIA A100-SXM4-80GB") == "dgx_a100"
    assert gc.cluster_for("NVIDIA GeForce RTX 4090") == "dgx_h100"


def test_a_step_is_logged_and_killed_past_its_time(tmp_path):
    log = tmp_path / "step.log"
    code = gc.run_logged([sys.executable, "-c", "import time; print('started', flush=True); "
                          "time.sleep(60)"], log, timeout_s=2)
    assert code == -9 and log.read_text() == "started\nkilled after 2 s\n"
    assert gc.run_logged([sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "b.log") == 3
