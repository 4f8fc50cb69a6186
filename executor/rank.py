"""One rank's process: `python -m executor.rank RUN_DIR` (spawned locally, by torchrun or by srun).

It reads who it is from the environment (env.py), the task from RUN_DIR/run.json,
joins the others over a gloo control group (barriers, gathering spans), runs the task
(replay a schedule, or a benchmark), and on any error writes RUN_DIR/errors/rankN.json
before exiting with code 1. Hydra never runs here: the launcher composed the config.

A rank of the local launcher dies with it, even when the launcher is SIGKILLed: on Linux
the kernel sends it SIGKILL when its parent goes (``prctl(PR_SET_PDEATHSIG)``), and on
every platform a thread exits the rank once its parent process is no longer the launcher
(``ParentWatch``). SIGTERM, SIGHUP and SIGINT keep their usual action (SIGTERM and SIGHUP
end the rank at once), except while ``files_kept_whole`` holds them for the few milliseconds rank 0 rewrites a
step's files, so that spans.json and summary.json always describe the same steps.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import importlib
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch and the IR load only inside run(): a rank imports this module first
    import torch
    import torch.distributed as dist

    from executor.env import RankEnv
    from executor.progress import Board, Reporter, Slot
    from twin.schedule.ir import Program

_REPORTER: Reporter | None = None  # this process's progress reporter, once known (for errors)

# run.json's "task": one of these names, or any "module:function" taking a RankContext
TASKS = {
    "replay": "executor.runner:replay_task",
    "bench_collectives": "executor.bench.collectives:bench_task",
    "replay_vs_bare": "executor.bench.allreduce:compare_task",
    "interference": "executor.interference:interference_task",
}


@dataclass
class RankContext:
    """What a task gets: identity, settings, the store and device, and the progress reporter."""

    run_dir: Path
    settings: dict[str, Any]
    """run.json as the launcher wrote it (task, world_size, timeouts, task options)."""
    env: RankEnv
    """Who this rank is and how it reaches the others."""
    store: dist.Store
    """The rendezvous store (TCP or file) every group of the run is built over."""
    device: torch.device
    """cuda:LOCAL_RANK with NCCL, else cpu."""
    backend: str
    """gloo or nccl (resolved from auto)."""
    reporter: Reporter
    """This rank's slot on the progress board: call before each op."""
    board: Board
    """The whole progress board (every rank's slot)."""

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size


def resolve_backend(name: str) -> str:
    """auto -> nccl when CUDA is present, else gloo."""
    import torch

    if name == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if name == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("backend=nccl needs CUDA, and this rank sees no GPU; use backend=gloo")
    if name not in ("gloo", "nccl"):
        raise ValueError(f"backend={name!r} is not one of auto|gloo|nccl")
    return name


def make_store(env: RankEnv, timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store: the local launcher's (TCP or file), or rank 0's (SLURM, env)."""
    import torch.distributed as dist

    if env.store_path:
        return dist.FileStore(env.store_path, env.world_size)
    if env.launcher == "local":
        return dist.TCPStore(env.master_addr, env.master_port, env.world_size, False,
                             timeout=timeout)
    return dist.TCPStore(env.master_addr, env.master_port, env.world_size, env.rank == 0,
                         timeout=timeout)


def _record_error(run_dir: Path, rank: int, err: BaseException,
                  reporter: Reporter | None) -> None:
    from twin.rundir import error_path, write_json

    slot = reporter.board.read(rank) if reporter is not None else None
    report = {"rank": rank, "type": type(err).__name__, "message": str(err),
              "traceback": traceback.format_exc(), "t_ns": time.monotonic_ns(),
              "phase": slot.phase if slot else "starting", "step": slot.step if slot else -1,
              "op": slot.op if slot else -1}
    try:
        error_path(run_dir, rank).parent.mkdir(parents=True, exist_ok=True)
        write_json(error_path(run_dir, rank), report)
    except OSError:
        pass


def run(run_dir: Path) -> None:
    """The body of a rank; raises on failure (``main`` records and exits)."""
    import torch
    import torch.distributed as dist

    from executor.env import rank_env
    from executor.progress import Board, Reporter, SelfWatchdog
    from twin.rundir import PROGRESS, read_settings

    settings = read_settings(run_dir)
    env = rank_env()
    if env.world_size != settings["world_size"]:
        raise RuntimeError(f"this run was prepared for {settings['world_size']} ranks but was "
                           f"started with WORLD_SIZE={env.world_size}; start "
                           f"{settings['world_size']} processes (torchrun --nproc-per-node ...)")
    local = env.launcher == "local"
    board = Board(env.world_size, run_dir / PROGRESS) if local else Board(env.world_size)
    reporter = Reporter(board, env.rank)
    global _REPORTER
    _REPORTER = reporter
    reporter.set_phase("init")
    if not local:
        SelfWatchdog(board, env.rank, float(settings["timeout_s"]),
                     on_stall=lambda msg: _record_error(run_dir, env.rank, TimeoutError(msg),
                                                        reporter),
                     describe=lambda slot: describe_slot({}, env.rank, slot)).start()
    torch.set_num_threads(int(settings.get("threads", 1)))
    backend = resolve_backend(settings.get("backend", "auto"))
    if backend == "nccl":
        torch.cuda.set_device(env.local_rank)
        device = torch.device("cuda", env.local_rank)
    else:
        device = torch.device("cpu")
    timeout = datetime.timedelta(seconds=float(settings["comm_timeout_s"]))
    if env.launcher == "torchrun":
        dist.init_process_group("gloo", init_method="env://", timeout=timeout)
        store = dist.distributed_c10d._get_default_store()
    else:
        store = make_store(env, timeout)
        dist.init_process_group("gloo", store=store, rank=env.rank, world_size=env.world_size,
                                timeout=timeout)
    if os.environ.get("PARATWIN_SPAWN_NS"):  # local runs: process start + joining the others
        settings["startup_s"] = (time.monotonic_ns() - int(os.environ["PARATWIN_SPAWN_NS"])) / 1e9
    spec = TASKS.get(settings["task"], settings["task"])
    if ":" not in spec:
        raise ValueError(f"task {settings['task']!r} is not one of {', '.join(TASKS)} nor a "
                         "'module:function' path")
    module, func = spec.split(":")
    task = getattr(importlib.import_module(module), func)
    ctx = RankContext(run_dir=run_dir, settings=settings, env=env, store=store, device=device,
                      backend=backend, reporter=reporter, board=board)
    task(ctx)
    reporter.set_phase("done")
    dist.destroy_process_group()


PR_SET_PDEATHSIG = 1  # linux/prctl.h
HELD_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def die_with_launcher() -> None:
    """Exit when the local launcher that spawned this rank goes, however it goes.

    Only for ``PARATWIN_LAUNCHER=local``: under torchrun or srun the parent is their
    agent, which owns the workers' lifetime (and on Linux the parent-death signal fires
    when the spawning *thread* ends, which only our own launcher guarantees to outlive us).
    """
    if os.environ.get("PARATWIN_LAUNCHER") != "local":
        return
    from executor.progress import ParentWatch

    launcher = int(os.environ.get("PARATWIN_LAUNCHER_PID") or os.getppid())
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the watch thread below still applies
    ParentWatch(launcher).start()  # also exits now if the launcher died before prctl


@contextlib.contextmanager
def files_kept_whole():
    """Hold SIGTERM, SIGHUP and SIGINT while a step's files are rewritten; act on them after.

    Outside this block SIGTERM and SIGHUP end the rank at once (their default action), even
    inside a collective, which a Python handler could not interrupt. The launcher gives ranks a
    grace before SIGKILL, so the writes finish. On another thread this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum))
                for sig in HELD_SIGNALS if signal.getsignal(sig) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        if caught:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(128 + caught[0])


def describe_slot(programs: dict[int, Program], rank: int, slot: Slot) -> str:
    """'measure, step 2, op 17 'fwd/mb0/L0/qkv' (gemm)' for messages about a rank's position."""
    where = f"{slot.phase}"
    if slot.step >= 0:
        where += f", step {slot.step}"
    if slot.op >= 0 and rank in programs and slot.op < len(programs[rank].ops):
        op = programs[rank].ops[slot.op]
        what = f"{op.kind}" + (f" on ranks {op.group}" if op.group else "")
        where += f", op {slot.op} {op.name!r} ({what})"
    if slot.waiting:
        where += ", waiting for communication"
    return where


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m executor.rank RUN_DIR", file=sys.stderr)
        sys.exit(2)
    run_dir = Path(argv[0]).resolve()
    try:  # a directory that was never prepared, or a damaged run.json: one line, no traceback
        from twin.rundir import read_settings

        read_settings(run_dir)
    except (OSError, ValueError) as err:
        print(f"python -m executor.rank: {err}", file=sys.stderr)
        sys.exit(2)
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "-1")))
    try:
        die_with_launcher()
        run(run_dir)
    except BaseException as err:  # noqa: BLE001 - every failure is reported, then the rank exits
        _record_error(run_dir, rank, err, _REPORTER)
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

