"""The same rank entry under torchrun (one node, --standalone) and under SLURM's variables."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from tests.executor.helpers import ROOT, paratwin  # noqa: E402
from twin.trace import Trace  # noqa: E402

pytestmark = [pytest.mark.multiprocess]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prepare(out) -> None:
    res = paratwin("execute", "launcher=torchrun", "steps=2", "warmup=1", "verify=true",
                   "timeout_s=30", "parallel=pp_1f1b", f"out_dir={out}")
    assert res.returncode == 0, res.stderr


def _run(cmds: list[list[str]], envs: list[dict], timeout: float) -> list[int]:
    """Start the commands in their own sessions; kill every one still running at ``timeout``."""
    procs = [subprocess.Popen(c, cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True) for c, e in zip(cmds, envs)]
    codes = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            codes.append(p.returncode)
            if p.returncode:
                print(out[-3000:])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return codes


def _env(**kw) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                "MASTER_"))}
    return {**env, "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": "lo", **kw}


@pytest.mark.timeout(120)
def test_torchrun_standalone_runs_a_prepared_directory(tmp_path):
    out = tmp_path / "torchrun"
    _prepare(out)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc-per-node", "2", "-m", "executor.rank", str(out)]
    assert _run([cmd], [_env()], timeout=100) == [0]
    trace = Trace.load(out / "spans.json")
    assert trace.steps() == [0, 1] and trace.meta["launcher"] == "torchrun"
    assert {s.rank for s in trace.spans} == {0, 1}


@pytest.mark.timeout(120)
def test_slurm_variables_stand_in_for_rank_and_world_size(tmp_path):
    out = tmp_path / "slurm"
    _prepare(out)
    port = _free_port()
    envs = [_env(SLURM_PROCID=str(r), SLURM_NTASKS="2", SLURM_LOCALID=str(r),
                 SLURM_JOB_NODELIST="localhost", MASTER_PORT=str(port)) for r in range(2)]
    cmds = [[sys.executable, "-m", "executor.rank", str(out)]] * 2
    assert _run(cmds, envs, timeout=100) == [0, 0]
    trace = Trace.load(out / "spans.json")
    assert trace.steps() == [0, 1] and trace.meta["launcher"] == "slurm"
