"""The executor never hangs: a crash, a hang, a port in use and a foreign listener each end in time,
with one clear message and no process left behind."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch")

from executor.launch import LaunchError, launch_local  # noqa: E402
from executor.progress import Board  # noqa: E402
from tests.executor.helpers import ROOT, alive, listening_addresses, paratwin, rank_pids  # noqa: E402
from twin import rundir  # noqa: E402
from twin.schedule.ir import Schedule  # noqa: E402
from twin.trace import Trace  # noqa: E402

pytestmark = [pytest.mark.multiprocess]


def _no_process_left(run_dir, world: int) -> None:
    pids = [p for p in rank_pids(run_dir, world) if p]
    assert pids, "the ranks never reported their pids"
    deadline = time.monotonic() + 5
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)]


@pytest.mark.timeout(100)
def test_a_crashing_rank_ends_the_run_with_its_error_and_keeps_completed_steps(tmp_path):
    out = tmp_path / "crash"
    t0 = time.monotonic()
    res = paratwin("execute", "steps=3", "warmup=1", "timeout_s=60", f"out_dir={out}",
                   "fault={kind: crash, rank: 1, step: 2, op: 30}", timeout=80)
    elapsed = time.monotonic() - t0
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("paratwin execute: rank 1 failed (measure, step 2, op 30 ")
    assert "RuntimeError: injected crash at rank 1, step 2, op 30" in lines[0]
    assert "the trace of 1 completed steps is kept" in lines[0]
    assert elapsed < 55  # inside timeout_s: a crash does not wait for the watchdog
    assert Trace.load(out / "spans.json").steps() == [0]  # step 1 (index 2) never completed
    assert json.loads((out / "summary.json").read_text())["steps"] == 1
    _no_process_left(out, 2)


@pytest.mark.timeout(90)
def test_a_hanging_rank_is_killed_by_the_watchdog_and_ranks_listen_on_loopback_only(tmp_path):
    out = tmp_path / "hang"
    cmd = [sys.executable, "-m", "paratwin.main", "execute", "steps=2", "warmup=1",
           "timeout_s=6", f"out_dir={out}", "fault={kind: hang, rank: 1, step: 1, op: 30}"]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        # while the ranks are alive (rank 1 hangs in step 1), read their listening sockets
        addresses = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if (out / "progress.bin").is_file():
                pids = [p for p in rank_pids(out, 2) if p]
                board = Board(2, out / "progress.bin")
                phases = [board.read(r).phase for r in range(2)]
                board.close()
                if len(pids) == 2 and all(ph == "measure" for ph in phases):
                    addresses = listening_addresses(pids)
                    break
            time.sleep(0.1)
        _, stderr = proc.communicate(timeout=80)
    finally:
        if proc.poll() is None:
            proc.kill()
    elapsed = time.monotonic() - t0
    assert proc.returncode == 1
    assert addresses and all(a in ("127.0.0.1", "::ffff:127.0.0.1") for a, _ in addresses), addresses
    line = stderr.strip().splitlines()[-1]
    stuck = Schedule.load(out / "schedule.json").program(1).ops[30].name
    assert "rank 1 made no progress for" in line and f"op 30 {stuck!r}" in line, stderr
    assert "all 2 ranks killed after timeout_s=6" in line and "rank 0: measure, step 1" in line
    assert elapsed < 6 + 45  # the timeout plus start-up, never an endless wait
    _no_process_left(out, 2)


@pytest.mark.timeout(90)
def test_a_port_in_use_is_retried_on_another(tmp_path):
    foreign = socket.socket()
    foreign.bind(("127.0.0.1", 0))
    foreign.listen(1)
    port = foreign.getsockname()[1]
    try:
        out = tmp_path / "port"
        res = paratwin("execute", "steps=1", "warmup=0", f"port={port}", f"out_dir={out}",
                       timeout=80)
    finally:
        foreign.close()
    assert res.returncode == 0, res.stderr
    assert f"port {port} on 127.0.0.1 is in use; trying another" in res.stderr
    assert Trace.load(out / "spans.json").steps() == [0]
    _no_process_left(out, 2)


@pytest.mark.timeout(60)
def test_ranks_stuck_on_a_foreign_listener_are_killed_by_our_own_timer(tmp_path):
    """A store address where another program listens (a reused port): the ranks connect and
    wait past any init timeout; the launcher's watchdog ends it."""
    foreign = socket.socket()
    foreign.bind(("127.0.0.1", 0))
    foreign.listen(8)
    port = foreign.getsockname()[1]
    run_dir = rundir.prepare(tmp_path / "foreign")
    rundir.write_json(run_dir / rundir.SETTINGS, {"task": "replay", "world_size": 2,
                                                  "timeout_s": 4, "comm_timeout_s": 300})
    t0 = time.monotonic()
    try:
        with pytest.raises(LaunchError) as err:
            launch_local(run_dir, 2, timeout_s=4, external_store=("127.0.0.1", port),
                         log=lambda m: None)
    finally:
        foreign.close()
    assert err.value.kind == "hang"
    assert f"never joined the rendezvous at 127.0.0.1:{port}" in str(err.value)
    assert time.monotonic() - t0 < 30
    _no_process_left(run_dir, 2)
