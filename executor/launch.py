"""Local launch: host the store on loopback, spawn one process per rank, watch them, leave nothing behind.

The launcher binds the rendezvous port itself (127.0.0.1 only; a port in use is retried
on another) and hosts the TCPStore on that socket for as long as the run lasts, so no
rank can reach a foreign listener on a reused port; ``rendezvous='file'`` uses a
FileStore in the run directory instead. Each rank is a new session (its own process
group), so killing it kills anything it started. The watchdog loop ends the run when:

- a rank exits with an error: the others are killed, and the message names the rank
  whose error came first (errors/rankN.json), with its phase, step and op;
- a rank makes no progress for ``timeout_s`` (progress board): all ranks are killed, and
  the message names the stalled rank (the one not waiting for communication, else the
  one stalled longest) and where every rank stood;
- the launcher gets SIGTERM, SIGHUP or SIGINT (``Interrupted``): the ranks get SIGTERM and
  ``GRACE_S`` to finish the step's files, then SIGKILL. Ranks also exit by themselves when
  the launcher dies, even by SIGKILL (``PARATWIN_LAUNCHER_PID``: see executor/rank.py).

On a cluster the same rank entry runs under torchrun or srun (``torchrun_commands``).
"""

from __future__ import annotations

import errno
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from executor.progress import Board, Slot
from twin import rundir

ROOT = Path(__file__).resolve().parents[1]
POLL_S = 0.05
GRACE_S = 2.0
"""After an interrupt, how long ranks have between SIGTERM and SIGKILL (rank 0 may be writing)."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
STARTUP_S = 30.0
"""A rank still importing (phase starting) this soon after spawn is slow to start, not stuck."""
JOIN_S = 1.0
"""A rank that began joining (phase init) less than this ago had no fair chance to join."""


class LaunchError(RuntimeError):
    """A run that failed: ``kind`` is crash, hang or exit; ``rank`` the rank blamed."""

    def __init__(self, message: str, kind: str, rank: int):
        super().__init__(message)
        self.kind, self.rank = kind, rank


class Interrupted(LaunchError):
    """The launcher got SIGTERM, SIGHUP or SIGINT: every rank was stopped; kind 'interrupted'."""

    def __init__(self, signum: int):
        self.signum = int(signum)
        self.signame = signal.Signals(signum).name
        super().__init__(f"interrupted by {self.signame}", "interrupted", -1)


@dataclass
class LaunchResult:
    """A local run that finished: where, how many ranks, and how it went."""

    run_dir: Path
    world_size: int
    pids: list[int] = field(default_factory=list)
    """The ranks' process ids, in rank order."""
    port: int | None = None
    """The rendezvous port on 127.0.0.1 (None with rendezvous=file)."""
    wall_s: float = 0.0
    """From the first spawn to the last rank's exit."""
    notes: list[str] = field(default_factory=list)
    """What the launcher had to work around (a port in use, ...)."""


def bind_loopback(port: int | None, log: Callable[[str], None]) -> socket.socket:
    """A listening socket on 127.0.0.1: ``port``, or another if it is taken (or None)."""
    for attempt in range(8):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        want = port if (port and attempt == 0) else 0
        try:
            sock.bind(("127.0.0.1", want))
        except OSError as err:
            sock.close()
            if err.errno != errno.EADDRINUSE:
                raise
            log(f"port {want} on 127.0.0.1 is in use; trying another")
            continue
        sock.listen(512)
        return sock
    raise OSError("could not bind a port on 127.0.0.1 after 8 tries")


def loopback_ifname() -> str:
    """The loopback interface's name (lo on Linux, lo0 on macOS)."""
    names = [n for _, n in socket.if_nameindex() if n.startswith("lo")]
    return names[0] if names else "lo"


def _kill(procs: list[subprocess.Popen], grace_s: float = 0.0) -> None:
    """Kill every rank's process group; with ``grace_s``, SIGTERM first and SIGKILL after."""
    if grace_s > 0:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    pass
        deadline = time.monotonic() + grace_s
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(POLL_S)
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


SECONDARY = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
             "did not complete within", "Timed out", "timed out", "NCCL communicator was aborted")


def _crash_message(run_dir: Path, world: int, failed: dict[int, int],
                   describe: Callable[[int, Slot], str], board: Board) -> LaunchError:
    errors = rundir.read_errors(run_dir)
    primary = [e for e in errors if not any(s in e.get("message", "") for s in SECONDARY)]
    if primary or errors:
        e = (primary or errors)[0]
        r = int(e["rank"])
        slot = Slot(0, e.get("step", -1), e.get("op", -1), False, e.get("phase", "?"), 0)
        msg = (f"rank {r} failed ({describe(r, slot)}): {e['type']}: {e['message']} "
               f"(log: {rundir.log_path(run_dir, r)})")
        return LaunchError(msg, "crash", r)
    r, code = next(iter(failed.items()))
    how = f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"
    msg = (f"rank {r} exited with {how} without an error report ({describe(r, board.read(r))}); "
           f"see {rundir.log_path(run_dir, r)}")
    return LaunchError(msg, "exit", r)


def _startup_message(stalled: int, slot: Slot, age_s: float, joined_s: dict[int, float],
                     timeout_s: float, describe: Callable[[int, Slot], str]) -> str:
    """The ranks were still starting when timeout_s ran out: the timeout is too short."""
    if joined_s:
        r, took = max(joined_s.items(), key=lambda kv: kv[1])
        need = (f"about {max(took, age_s):.1f} s to start on this machine (rank {r} joined "
                f"the others {took:.1f} s after it was spawned)")
    else:
        need = f"more than {age_s:.1f} s to start on this machine (import torch, join the others)"
    raise_to = max(30, math.ceil(10 * max([age_s, *joined_s.values()])))
    return (f"rank {stalled} was still starting {age_s:.1f} s after the ranks were spawned "
            f"({describe(stalled, slot)}): ranks need {need}, and timeout_s={timeout_s:g} is too "
            f"short for that: raise it (e.g. timeout_s={raise_to})")


def _hang_message(world: int, board: Board, now_ns: int, spawn_ns: int, timeout_s: float,
                  describe: Callable[[int, Slot], str], rendezvous: str,
                  joined_ns: dict[int, int] | None = None) -> LaunchError:
    """Name the stalled rank; ``joined_ns``: when each rank was first seen past start-up."""
    slots = {r: board.read(r) for r in range(world)}

    def idle(r: int) -> float:
        return (now_ns - (slots[r].t_ns or spawn_ns)) / 1e9

    busy = [r for r in range(world) if not slots[r].waiting and slots[r].phase != "done"]
    stalled = max(busy or range(world), key=idle)
    others = "; ".join(f"rank {r}: {describe(r, slots[r])}" for r in range(world) if r != stalled)
    age_s = (now_ns - spawn_ns) / 1e9
    phase = slots[stalled].phase
    if (phase == "starting" and age_s < STARTUP_S) or (phase == "init" and idle(stalled) < JOIN_S):
        joined_s = {r: (t - spawn_ns) / 1e9 for r, t in (joined_ns or {}).items()}
        msg = (_startup_message(stalled, slots[stalled], age_s, joined_s, timeout_s, describe)
               + f"; all {world} ranks killed" + (f" [{others}]" if others else ""))
        return LaunchError(msg, "hang", stalled)
    hint = ""
    if phase in ("starting", "init"):
        hint = (f"; it never joined the rendezvous at {rendezvous} (another program listening "
                "there, or a rank that could not start: see its log)")
    msg = (f"rank {stalled} made no progress for {idle(stalled):.1f} s "
           f"({describe(stalled, slots[stalled])}){hint}; all {world} ranks killed after "
           f"timeout_s={timeout_s:g}" + (f" [{others}]" if others else ""))
    return LaunchError(msg, "hang", stalled)


def _catch_stop_signals(caught: list[int]) -> dict[int, object]:
    """Note SIGTERM, SIGHUP and SIGINT in ``caught`` (the watch loop raises Interrupted).

    Only on the main thread (Python's rule), and not for a signal that is ignored (nohup,
    a background job): that choice belongs to whoever started us. Returns the handlers
    to restore.
    """
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {}
    for sig in STOP_SIGNALS:
        old = signal.getsignal(sig)
        if old is signal.SIG_IGN:
            continue
        previous[sig] = old
        signal.signal(sig, lambda signum, frame: caught.append(signum))
    return previous


def _restore_signals(previous: dict[int, object]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def launch_local(run_dir: str | Path, world_size: int, *, timeout_s: float,
                 port: int | None = None, rendezvous: str = "tcp", threads: int = 1,
                 describe: Callable[[int, Slot], str] | None = None,
                 log: Callable[[str], None] = print,
                 external_store: tuple[str, int] | None = None,
                 entry: str = "executor.rank") -> LaunchResult:
    """Run ``python -m entry RUN_DIR`` as ``world_size`` local ranks; raise LaunchError on failure.

    ``external_store``: connect the ranks to a store someone else hosts instead of hosting
    one (the watchdog still bounds the wait if nobody answers there).
    """
    import torch.distributed as dist

    run_dir = Path(run_dir).resolve()
    if describe is None:
        from executor.rank import describe_slot

        def describe(r: int, slot: Slot) -> str:
            return describe_slot({}, r, slot)

    board = Board(world_size, run_dir / rundir.PROGRESS, create=True)
    result = LaunchResult(run_dir, world_size)
    env = dict(os.environ)
    env.update(WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", PARATWIN_LAUNCHER="local",
               PARATWIN_LAUNCHER_PID=str(os.getpid()),
               PARATWIN_LOOPBACK="1", GLOO_SOCKET_IFNAME=loopback_ifname(),
               OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in
                                                         [os.environ.get("PYTHONPATH")] if p]))
    store = None
    if rendezvous == "file":
        env["PARATWIN_STORE_PATH"] = str(run_dir / "store")
        env["MASTER_PORT"] = "0"
    elif external_store is not None:
        env["MASTER_ADDR"], env["MASTER_PORT"] = external_store[0], str(external_store[1])
        result.port = external_store[1]
    else:
        sock = bind_loopback(port, lambda m: (result.notes.append(m), log(m)))
        result.port = sock.getsockname()[1]
        try:
            store = dist.TCPStore("127.0.0.1", result.port, world_size, True,
                                  wait_for_workers=False, master_listen_fd=sock.fileno())
        except BaseException:
            sock.close()
            raise
        sock.detach()  # the store owns the listening socket now and closes it
        env["MASTER_PORT"] = str(result.port)
    where = env.get("PARATWIN_STORE_PATH") or f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    procs: list[subprocess.Popen] = []
    logs = []
    joined_ns: dict[int, int] = {}  # when each rank was first seen past start-up
    t0 = time.monotonic()
    spawn_ns = time.monotonic_ns()
    caught: list[int] = []
    previous = _catch_stop_signals(caught)
    grace_s = 0.0
    try:
        for r in range(world_size):
            fh = open(rundir.log_path(run_dir, r), "w")  # closed in finally
            logs.append(fh)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", entry, str(run_dir)],
                env={**env, "RANK": str(r), "LOCAL_RANK": str(r),
                     "PARATWIN_SPAWN_NS": str(time.monotonic_ns())}, stdout=fh,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True))
        result.pids = [p.pid for p in procs]
        while True:
            if caught:
                grace_s = GRACE_S
                raise Interrupted(caught[0])
            codes = {r: p.poll() for r, p in enumerate(procs)}
            failed = {r: c for r, c in codes.items() if c not in (None, 0)}
            if failed:
                time.sleep(0.2)  # let a failing rank finish writing its report
                _kill(procs)
                raise _crash_message(run_dir, world_size, failed, describe, board)
            if all(c == 0 for c in codes.values()):
                break
            now = time.monotonic_ns()
            for r in range(world_size):
                slot = board.read(r)
                if r not in joined_ns and slot.phase not in ("starting", "init"):
                    joined_ns[r] = slot.t_ns
                if codes[r] is None and slot.phase != "done" and \
                        now - (slot.t_ns or spawn_ns) > timeout_s * 1e9:
                    _kill(procs)
                    raise _hang_message(world_size, board, now, spawn_ns, timeout_s, describe,
                                        where, joined_ns)
            time.sleep(POLL_S)
        if caught:  # a signal after the last rank finished: still honoured
            raise Interrupted(caught[0])
    finally:
        _kill(procs, grace_s)
        _restore_signals(previous)
        for fh in logs:
            fh.close()
        board.close()
        del store
        if rendezvous == "file":
            (run_dir / "store").unlink(missing_ok=True)
        for pid in result.pids:  # a rank killed mid-write leaves its temporary file
            for tmp in run_dir.glob(f".*.{pid}.tmp"):
                tmp.unlink(missing_ok=True)
    result.wall_s = time.monotonic() - t0
    return result


def torchrun_commands(run_dir: str | Path, world_size: int, gpus_per_node: int) -> dict[str, str]:
    """The commands that run a prepared run directory under torchrun (one node or many) or srun."""
    nodes = max(1, -(-world_size // gpus_per_node))
    per_node = min(world_size, gpus_per_node)
    entry = f"-m executor.rank {run_dir}"
    return {
        "single_node": f"torchrun --standalone --nnodes 1 --nproc-per-node {per_node} {entry}",
        "multi_node": (f"torchrun --nnodes {nodes} --nproc-per-node {per_node} "
                       "--rdzv-backend c10d --rdzv-endpoint $HEAD_NODE:29500 --rdzv-id $JOB_ID "
                       f"{entry}"),
        "slurm": (f"srun --nodes {nodes} --ntasks-per-node {per_node} --gpus-per-task 1 "
                  f"python {entry}  # MASTER_ADDR defaults to the first host of the allocation"),
    }
