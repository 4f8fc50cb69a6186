"""Process hygiene of `paratwin execute`: a signal to the launcher, or its death, leaves no rank
running; the completed steps are kept; a too-short timeout_s is named as such."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests.executor.helpers import ROOT, alive, paratwin, rank_pids  # noqa: E402
from twin.trace import Trace  # noqa: E402

pytestmark = [pytest.mark.multiprocess]

JOB = ("model=tiny", "cluster=cpu_local", "parallel=ddp")
KILL_AFTER_S = 60  # every process a test starts is SIGKILLed by then, whatever happens


def _processes_of(run_dir: Path) -> list[int]:
    """Live processes (not zombies) whose command line names the run directory."""
    needles = {str(run_dir).encode(), str(run_dir.resolve()).encode()}
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if any(n in cmdline for n in needles) and alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def _kill_all(proc: subprocess.Popen, run_dir: Path) -> None:
    """SIGKILL the launcher's session and every process that names the run directory."""
    for kill, pid in [(os.killpg, proc.pid)] + [(os.kill, p) for p in _processes_of(run_dir)]:
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _default_signals() -> None:
    """In the child: SIGINT and SIGHUP as a terminal user has them (a test runner may ignore them)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def _start(out: Path) -> tuple[subprocess.Popen, threading.Timer]:
    """`paratwin execute` for 300 steps in its own session, under a kill timer."""
    cmd = [sys.executable, "-m", "paratwin.main", "execute", *JOB, "steps=300", "warmup=1",
           "timeout_s=60", f"out_dir={out}", "report=false"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_default_signals)
    timer = threading.Timer(KILL_AFTER_S, _kill_all, (proc, out))
    timer.start()
    return proc, timer


def _wait_for_a_step(proc: subprocess.Popen, out: Path) -> None:
    deadline = time.monotonic() + 45
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        try:
            if json.loads((out / "summary.json").read_text()).get("steps", 0) >= 1:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    pytest.fail("no measured step completed within 45 s")


def _none_left_within(out: Path, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while _processes_of(out) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _processes_of(out), [Path(f"/proc/{p}/cmdline").read_bytes()
                                    for p in _processes_of(out)]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP],
                         ids=["TERM", "INT", "HUP"])
def test_a_signal_ends_the_run_cleanly_and_keeps_the_completed_steps(sig, tmp_path):
    out = tmp_path / "run"
    proc, timer = _start(out)
    try:
        _wait_for_a_step(proc, out)
        t0 = time.monotonic()
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=20)
        elapsed = time.monotonic() - t0
        assert proc.returncode == 128 + sig, stderr
        assert elapsed < 10  # the ranks' grace (2 s) and the kill, never an endless wait
        lines = stderr.strip().splitlines()
        assert len(lines) == 1, stderr
        assert lines[0].startswith(f"paratwin execute: interrupted by {sig.name}; ")
        assert f"steps kept in {out}" in lines[0]
        assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
        _none_left_within(out, 5)
        summary = json.loads((out / "summary.json").read_text())
        assert summary["steps"] >= 1
        assert f"; {summary['steps']} steps kept in" in lines[0]
        # rank 0 writes both files of a step before it honours the signal: they agree
        assert len(Trace.load(out / "spans.json").steps()) == summary["steps"]
        assert not list(out.glob(".*.tmp"))
    finally:
        timer.cancel()
        _kill_all(proc, out)


@pytest.mark.timeout(90)
def test_ranks_exit_when_their_launcher_is_killed(tmp_path):
    out = tmp_path / "killed"
    proc, timer = _start(out)
    try:
        _wait_for_a_step(proc, out)
        pids = [p for p in rank_pids(out, 2) if p]
        assert len(pids) == 2 and all(alive(p) for p in pids)
        proc.kill()  # SIGKILL: the launcher runs no code of its own any more
        proc.communicate(timeout=10)
        t0 = time.monotonic()
        while any(alive(p) for p in pids) and time.monotonic() - t0 < 5:
            time.sleep(0.05)
        assert not [p for p in pids if alive(p)]
        _none_left_within(out, 1)
    finally:
        timer.cancel()
        _kill_all(proc, out)


@pytest.mark.timeout(60)
def test_a_timeout_shorter_than_start_up_is_named_as_such(tmp_path):
    out = tmp_path / "short"
    # 0.1 s: shorter than any rank's start-up (an interpreter importing torch), which a 1 s
    # timeout was not always on a quiet host (each start-up phase reports progress)
    res = paratwin("execute", *JOB, "steps=1", "warmup=0", "timeout_s=0.1", f"out_dir={out}",
                   "report=false", timeout=45)
    assert res.returncode == 1, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert "was still starting" in lines[0] and "to start on this machine" in lines[0]
    assert "timeout_s=0.1 is too short" in lines[0] and "raise it (e.g. timeout_s=30)" in lines[0]
    assert "another program listening" not in lines[0]
    _none_left_within(out, 5)
