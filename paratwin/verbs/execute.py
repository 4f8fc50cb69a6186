"""`paratwin execute`: compose once, check everything, write the run directory, spawn the ranks, report.

Hydra runs here only; the ranks read RUN_DIR/run.json and RUN_DIR/schedule.json. Every
config problem is a ConfigError raised before any process starts. With
``launcher=torchrun`` the run directory is prepared and the torchrun/srun commands that
run it are printed instead.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from omegaconf import OmegaConf

from executor.collectives import MAX_VERIFY_WORLD
from paratwin.config import job_from_cfg
from twin import rundir
from twin.schedule.builder import build_schedule
from twin.schedule.check import check_schedule, memory_peak
from twin.spec import ConfigError
from twin.spec.errors import check_choice, check_positive

MAX_LOCAL_WORLD = 64
FAULT_KINDS = ("crash", "hang")


def settings_from_cfg(cfg) -> dict:
    """The ranks' settings (run.json) from the composed config; every problem at once."""
    problems: list[str] = []
    steps, warmup = cfg.get("steps", 5), cfg.get("warmup", 2)
    if not isinstance(steps, int) or steps < 1:
        problems.append(f"steps={steps!r} must be a whole number >= 1 (measured steps)")
    if not isinstance(warmup, int) or warmup < 0:
        problems.append(f"warmup={warmup!r} must be a whole number >= 0")
    check_positive(problems, "timeout_s", cfg.get("timeout_s", 60))
    check_choice(problems, "backend", cfg.get("backend", "auto"), ("auto", "gloo", "nccl"))
    check_choice(problems, "format", cfg.get("format", "text"), ("text", "json"))
    check_choice(problems, "launcher", cfg.get("launcher", "local"), ("local", "torchrun"))
    check_choice(problems, "rendezvous", cfg.get("rendezvous", "tcp"), ("tcp", "file"))
    threads = cfg.get("threads", 1)
    if not isinstance(threads, int) or threads < 1:
        problems.append(f"threads={threads!r} must be a whole number >= 1")
    port = cfg.get("port")
    if port is not None and (not isinstance(port, int) or not 0 < port < 65536):
        problems.append(f"port={port!r} must be null (any free port) or in 1..65535")
    if not cfg.get("out_dir"):
        problems.append("out_dir is empty; give a run directory (default "
                        "reports/execute/<timestamp>)")
    fault = cfg.get("fault")
    if fault is not None:
        fault = OmegaConf.to_container(fault) if not isinstance(fault, dict) else dict(fault)
        unknown = set(fault) - {"kind", "rank", "step", "op"}
        if unknown or fault.get("kind") not in FAULT_KINDS:
            problems.append(f"fault={fault} must be {{kind: crash|hang, rank: R, step: S, op: I}}")
    if problems:
        raise ConfigError(problems)
    timeout_s = float(cfg.get("timeout_s", 60))
    return {"task": "replay", "steps": steps, "warmup": warmup, "timeout_s": timeout_s,
            # collectives and waits give up later than the watchdog, which names the culprit
            "comm_timeout_s": 2 * timeout_s + 30, "backend": cfg.get("backend", "auto"),
            "threads": threads, "verify": bool(cfg.get("verify", False)), "fault": fault}


def _available_bytes() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def check_job(job, programs: dict, settings: dict, local: bool) -> None:
    """Problems that would only show once the ranks run, raised now as a ConfigError."""
    from executor.kernels import workspace_estimate

    world = job.grid.world_size
    problems: list[str] = []
    fault = settings["fault"]
    if fault:
        rank, step, op = fault.get("rank", 0), fault.get("step", 0), fault.get("op", 0)
        total = settings["warmup"] + settings["steps"]
        if not 0 <= rank < world:
            problems.append(f"fault.rank={rank} is outside 0..{world - 1}")
        elif not 0 <= op < len(programs[rank].ops):
            problems.append(f"fault.op={op} is outside rank {rank}'s {len(programs[rank].ops)} ops")
        if not 0 <= step < total:
            problems.append(f"fault.step={step} is outside the {total} steps (warm-up included)")
    if settings["verify"] and world > MAX_VERIFY_WORLD:
        problems.append(f"verify=true checks exact sums of 2**rank in fp64, which holds up to "
                        f"{MAX_VERIFY_WORLD} ranks; this job has {world}")
    if local:
        import torch

        backend = settings["backend"]
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl" and torch.cuda.device_count() < world:
            problems.append(f"backend=nccl runs one rank per GPU: {world} ranks but this host has "
                            f"{torch.cuda.device_count()} GPUs; use backend=gloo, fewer ranks "
                            "(cluster.gpus_per_node) or launcher=torchrun on several nodes")
        if world > MAX_LOCAL_WORLD:
            problems.append(f"{world} ranks is too many to spawn on one host (at most "
                            f"{MAX_LOCAL_WORLD}); use launcher=torchrun across nodes")
        if backend == "gloo":
            need = max(workspace_estimate(p.ops) + 3 * max((o.bytes for o in p.ops
                                                            if o.is_collective or o.is_p2p),
                                                           default=0)
                       for p in programs.values())
            have = _available_bytes()
            if need * world > 0.8 * have:
                problems.append(f"{job.model.name} on {world} ranks needs about "
                                f"{need * world / 1e9:.1f} GB of host memory for kernel inputs, "
                                f"optimizer states and message buffers, and this host has "
                                f"{have / 1e9:.1f} GB available; use model=tiny or fewer ranks")
    if problems:
        raise ConfigError(problems)


def prepare_run(cfg, settings: dict):
    """Build and check the job and schedule, write the run directory; returns (job, programs, dir)."""
    job = job_from_cfg(cfg)
    world = job.grid.world_size
    if world > 1024:
        raise ConfigError(f"the executor builds every rank's program; {world} ranks is beyond "
                          "what it replays (at most 1024)")
    schedule = build_schedule(job)
    programs = schedule.programs()
    check_schedule(programs)
    for p in programs.values():
        memory_peak(p)  # every free matches an alloc
    check_job(job, programs, settings, local=cfg.get("launcher", "local") == "local")
    run_dir = rundir.prepare(Path(str(cfg.out_dir)), "execute", bool(cfg.get("force", False)))
    (run_dir / rundir.CONFIG).write_text(OmegaConf.to_yaml(cfg, resolve=True))
    schedule.save(run_dir / rundir.SCHEDULE)
    rundir.write_json(run_dir / rundir.SETTINGS, {**settings, "world_size": world,
                                                  "gpus_per_node": job.cluster.gpus_per_node})
    return job, programs, run_dir


def format_summary(job, summary: dict, run_dir: Path) -> str:
    ms = 1e3
    par = job.parallel
    lines = [
        f"{job.model.name} on {job.cluster.name}: dp={par.dp} tp={par.tp} pp={par.pp} "
        f"zero={par.zero_stage}" + (f" cp={par.cp} ({par.cp_method}, {par.cp_load_balance})"
                                    if par.cp > 1 else "")
        + f", {summary['world_size']} ranks ({summary['backend']}), "
        f"{summary['steps']} measured steps after {summary['warmup']} warm-up",
        f"step time: median {summary['step_time_s'] * ms:.2f} ms (p10 "
        f"{summary['step_time_p10_s'] * ms:.2f}, p90 {summary['step_time_p90_s'] * ms:.2f})",
        f"tokens/s: {summary['tokens_per_s']:.4g}   TFLOP/s per rank: "
        f"{summary['tflops_per_gpu']:.4g}   MFU: {summary['mfu']:.3g}",
        "peak memory per rank (schedule buffers, measured): " + ", ".join(
            f"rank {r} {b / 1e6:.2f} MB" for r, b in summary["measured_peak_memory_bytes"].items()),
    ]
    if summary.get("exposed_comm_s"):
        lines.append("exposed communication: " + ", ".join(
            f"{g} {v * ms:.2f} ms" for g, v in summary["exposed_comm_s"].items()))
    if summary.get("verify"):
        lines.append("verify: every collective and p2p result checked")
    lines.append(f"run directory: {run_dir} (spans.json: the trace; trace.json: Chrome/Perfetto; "
                 "summary.json, config.yaml, schedule.json, logs/)")
    return "\n".join(lines)


def _steps_kept(run_dir: Path) -> int:
    """Measured steps in the run directory's summary.json (0 when there is none or it is unreadable)."""
    try:
        summary = rundir.read_summary(run_dir)
    except (OSError, ValueError):
        return 0
    steps = (summary or {}).get("steps", 0)
    return steps if isinstance(steps, int) else 0


def _say(message: str) -> None:
    """One line on stderr; a terminal that hung up (SIGHUP) may no longer take it."""
    try:
        print(f"paratwin execute: {message}", file=sys.stderr, flush=True)
    except OSError:
        pass


def run(cfg) -> dict:
    """Run the composed job for real; exit 1 with one line when a rank fails or hangs.

    SIGTERM, SIGHUP or SIGINT while the ranks run stop them all and exit with 128+signum
    and one line saying how many steps were kept; Ctrl-C outside that window exits 130
    without a traceback too.
    """
    try:
        return _run(cfg)
    except KeyboardInterrupt:  # before the ranks start or after they finished
        _say("interrupted by SIGINT")
        sys.exit(128 + signal.SIGINT)


def _run(cfg) -> dict:
    from executor.launch import Interrupted, LaunchError, launch_local, torchrun_commands
    from executor.rank import describe_slot

    settings = settings_from_cfg(cfg)
    job, programs, run_dir = prepare_run(cfg, settings)
    world = job.grid.world_size
    fmt = cfg.get("format", "text")
    if cfg.get("launcher", "local") == "torchrun":
        cmds = torchrun_commands(run_dir, world, job.cluster.gpus_per_node)
        out = {"run_dir": str(run_dir), "world_size": world, "commands": cmds}
        if fmt == "json":
            print(json.dumps(out, indent=2))
        else:
            print(f"prepared {run_dir} for {world} ranks; run it from the repository root with:\n"
                  + "\n".join(f"  {k}: {v}" for k, v in cmds.items()))
        return out

    try:
        launch_local(run_dir, world, timeout_s=settings["timeout_s"], port=cfg.get("port"),
                     rendezvous=cfg.get("rendezvous", "tcp"), threads=settings["threads"],
                     describe=lambda r, slot: describe_slot(programs, r, slot), log=_say)
    except Interrupted as err:
        _say(f"{err}; {_steps_kept(run_dir)} steps kept in {run_dir}")
        sys.exit(128 + err.signum)
    except LaunchError as err:
        kept = ""
        if (run_dir / rundir.SUMMARY).is_file():
            kept = (f"; the trace of {_steps_kept(run_dir)} completed steps is kept in "
                    f"{run_dir / rundir.TRACE}")
        _say(f"{err}{kept}")
        sys.exit(1)
    summary = json.loads((run_dir / rundir.SUMMARY).read_text())
    if cfg.get("report", True):
        from twin.report import write_report

        write_report([run_dir])
    print(json.dumps(summary, indent=2) if fmt == "json" else format_summary(job, summary, run_dir))
    return summary
