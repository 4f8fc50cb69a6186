"""The replay task of a rank: warm-up, measured steps aligned at a barrier, the trace kept step by step.

Per step every rank meets the others at a barrier of the gloo control group and reads
its clock (``perf_counter_ns``) as it leaves: that is the step's origin on the rank. The
trace's time axis starts at rank 0's origin of the first measured step. Ranks on one host
share CLOCK_MONOTONIC, so there each op is placed by its own clock reading, exactly; the
spread of the barrier exits (``barrier_exit_spread_us`` in the meta: 0.1-2 ms on a busy
2-core host) is what aligning by the barrier alone would have cost. Across hosts the
clocks differ, so each rank's step origin is taken to be rank 0's: the error is that
spread (a network latency plus scheduling). After each measured step rank 0 gathers every
rank's op times and rewrites spans.json (the trace) and summary.json atomically, so a
failure later keeps the completed steps (a SIGTERM waits for both files: ``files_kept_whole``);
trace.json (the Chrome export) is written at the end.
"""

from __future__ import annotations

import platform
import socket
import statistics
import time

import torch
import torch.distributed as dist

from executor.groups import build_comms
from executor.rank import RankContext, files_kept_whole
from executor.replay import Fault, Replayer
from twin.chrome import chrome_trace
from twin.metrics import summarize
from twin.rundir import CHROME, SCHEDULE, SUMMARY, TRACE, write_json
from twin.schedule.ir import Schedule
from twin.spec.io import job_to_dict
from twin.trace import Span, Trace


def spans_of(program, step: int, times: list[tuple[int, int]], base_us: float) -> list[Span]:
    """One span per op (Span.op == Op.name) at ``base_us`` + the op's times from the step origin."""
    return [Span.of(op, program.rank, step, base_us + start / 1e3, base_us + end / 1e3)
            for op, (start, end) in zip(program.ops, times)]


def run_meta(ctx: RankContext, job, measured: int) -> dict:
    s = ctx.settings
    return {"source": "executor", "world_size": ctx.world_size,
            "gpus_per_node": job.cluster.gpus_per_node, "job": job_to_dict(job),
            "backend": ctx.backend, "device": _device_name(ctx.device), "host": socket.gethostname(),
            "torch_version": torch.__version__, "python": platform.python_version(),
            "steps": measured, "steps_planned": s["steps"], "warmup": s["warmup"],
            "launcher": ctx.env.launcher, "verify": bool(s.get("verify")),
            "threads_per_rank": s.get("threads", 1),
            "time_origin": "rank 0 leaving the barrier before the first measured step"}


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def replay_task(ctx: RankContext) -> None:
    """Replay the run directory's schedule for warmup + steps steps (see module docstring)."""
    s = ctx.settings
    schedule = Schedule.load(ctx.run_dir / SCHEDULE)
    job = schedule.job
    programs = schedule.programs()
    rank, world = ctx.rank, ctx.world_size
    ctx.reporter.set_phase("groups")
    comm_timeout = float(s["comm_timeout_s"])
    comms = build_comms(programs, rank, world, ctx.store, ctx.backend, comm_timeout,
                        loopback=ctx.env.loopback)
    fault = Fault(**s["fault"]) if s.get("fault") else None
    cls = Replayer
    if ctx.backend == "nccl":
        from executor.replay_cuda import CudaReplayer

        cls = CudaReplayer
    replayer = cls(programs[rank], comms, ctx.device, verify=bool(s.get("verify")),
                   wait_timeout_s=comm_timeout, reporter=ctx.reporter, fault=fault)
    warmup, steps = int(s["warmup"]), int(s["steps"])
    trace = Trace(meta=run_meta(ctx, job, 0))
    hosts = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    one_host = len(set(hosts)) == 1
    trace.meta["clock"] = ("CLOCK_MONOTONIC shared by the ranks on one host" if one_host else
                           "per-host clocks aligned at each step's barrier")
    first_origin = None
    measured_peak: dict[str, float] = {}
    issued: dict[str, list[float]] = {}
    by_kind: dict[str, dict[str, list[float]]] = {}
    spread = 0.0
    for step in range(warmup + steps):
        measured = step >= warmup
        ctx.reporter.set_phase("measure" if measured else "warmup", step)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
            torch.cuda.reset_peak_memory_stats(ctx.device)
        dist.barrier()
        result = replayer.run_step(step)
        if not measured:
            continue
        ctx.reporter.set_phase("writing", step)
        peak = (torch.cuda.max_memory_allocated(ctx.device) if ctx.device.type == "cuda"
                else result.peak_bytes)
        payload = {"rank": rank, "times": result.times, "origin_ns": replayer.origin_ns,
                   "issued_ns": result.issued_ns, "host_ns_by_kind": result.host_ns_by_kind,
                   "startup_s": s.get("startup_s"),
                   "peak": peak, "workspace": replayer.kernels.workspace_bytes
                   + replayer.pool.held_bytes}
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(payload, gathered, dst=0)
        if rank != 0:
            continue
        origin0 = gathered[0]["origin_ns"]
        if first_origin is None:
            first_origin = origin0
        for p in gathered:
            base_us = ((p["origin_ns"] if one_host else origin0) - first_origin) / 1e3
            trace.spans.extend(spans_of(programs[p["rank"]], step - warmup, p["times"], base_us))
            key = str(p["rank"])
            measured_peak[key] = max(measured_peak.get(key, 0.0), float(p["peak"]))
            issued.setdefault(key, []).append(p["issued_ns"] / 1e9)
            for kind, ns in p["host_ns_by_kind"].items():
                by_kind.setdefault(key, {}).setdefault(kind, []).append(ns / 1e9)
            spread = max(spread, abs(p["origin_ns"] - origin0) / 1e3)
        with files_kept_whole():  # spans.json and summary.json of the same steps
            trace.meta.update(steps=step - warmup + 1)
            if one_host:
                trace.meta["barrier_exit_spread_us"] = spread
            trace.save(ctx.run_dir / TRACE)
            if step == warmup + steps - 1:  # the Chrome export once, at the end
                write_json(ctx.run_dir / CHROME, chrome_trace(trace), indent=None)
            summary = summarize(trace, job)
            summary.extra.update({
                "source": "executor", "backend": ctx.backend, "device": trace.meta["device"],
                "steps_planned": steps, "warmup": warmup, "verify": bool(s.get("verify")),
                "measured_peak_memory_bytes": measured_peak,
                "measured_peak_memory_max_bytes": max(measured_peak.values()),
                "measured_memory_source": ("torch.cuda.max_memory_allocated"
                                           if ctx.device.type == "cuda" else
                                           "executor count of live alloc/free buffers"),
                "workspace_bytes": {str(p["rank"]): p["workspace"] for p in gathered},
                "host_issue_s": {k: statistics.median(v) for k, v in issued.items()},
                "host_issue_by_kind_s": {k: {kind: statistics.median(v) for kind, v in kinds.items()}
                                         for k, kinds in by_kind.items()},
                "startup_s": {str(p["rank"]): p["startup_s"] for p in gathered
                              if p["startup_s"] is not None},
                "clock": trace.meta["clock"],
                "barrier_exit_spread_us": trace.meta.get("barrier_exit_spread_us"),
                "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            })
            write_json(ctx.run_dir / SUMMARY, summary.to_dict())
    ctx.reporter.set_phase("done")
    dist.barrier()
