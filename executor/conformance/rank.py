"""One conformance rank: `python -m executor.conformance.rank RUN_DIR` (spawned by launch_local).

It runs inside executor.rank's process setup (environment, store, gloo world group,
timeouts, error reports, progress board) as the ``conformance`` task: build the model
from the job in RUN_DIR/run.json, parallelise it with PyTorch's APIs, train ``steps``
steps with every collective and p2p call recorded, and write
RUN_DIR/conformance/rankN.json (calls, losses, gradient norms, step times).

Timing: each step (forward, backward, gradient sync, clip, AdamW, zero_grad; not the
batch's creation) is timed on every rank with perf_counter and no barrier, so the run's
step time is the largest rank's (runner.step_timing). ``profile_step`` (run.json, optional)
runs that one step under torch.profiler and writes its CPU time per op kind
(train.profile_kinds); the profiled step is left out of the timing.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

import torch

TASK = "conformance"
OUT = "conformance"


def result_path(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / OUT / f"rank{rank}.json"


def _pipeline_schedule(parts, job, mesh, device):
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleDualPipeV,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    from executor.conformance.model import loss_fn

    p = job.parallel
    group = mesh["pp"].get_group()
    stages = [PipelineStage(mod, chunk, p.num_stages, device, group=group) for chunk, mod in parts]
    if p.pp_schedule_csv is not None:  # torch reads the table itself (and infers the placement)
        sched = _PipelineScheduleRuntime(stages, n_microbatches=p.num_microbatches, loss_fn=loss_fn)
        sched._load_csv(p.pp_schedule_csv)
        return sched
    multi = {"interleaved": ScheduleInterleaved1F1B, "zb_h1": ScheduleInterleavedZeroBubble,
             "zb_v": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}
    if p.pp_schedule in multi:
        return multi[p.pp_schedule](stages, n_microbatches=p.num_microbatches, loss_fn=loss_fn)
    cls = ScheduleGPipe if p.pp_schedule == "gpipe" else Schedule1F1B
    return cls(stages[0], n_microbatches=p.num_microbatches, loss_fn=loss_fn)


def conformance_task(ctx) -> None:
    """The ``conformance`` task of executor.rank: train, record, write the rank's result."""
    import torch.distributed as dist

    from executor.conformance.capture import Recorder
    from executor.conformance.experts import expert_sync_of
    from executor.conformance.model import build_model
    from executor.conformance.parallelize import device_mesh, parallelize
    from executor.conformance.train import (
        OPT_RANGE,
        clip,
        data_step,
        loss_context,
        optimizer,
        profile_kinds,
        profiler,
        replicate_partial_grads,
        step_batch,
    )
    from twin.rundir import write_json
    from twin.spec.io import job_from_dict

    s = ctx.settings
    job = job_from_dict(s["job"])
    rank, p = ctx.rank, job.parallel
    recorder = Recorder(rank).install()
    ctx.reporter.set_phase("groups")
    mesh = device_mesh(job)
    norm_group = _norm_group(job, rank)
    parts = parallelize(build_model(job.model, s["seed"]), job, mesh)
    experts = expert_sync_of(parts)  # a MoE model's routed experts (None: dense or ep=1)
    chunks = [c for c, _, _ in parts]
    named = [(_plain_name(n), q) for _, m, _ in parts for n, q in m.named_parameters()]
    sharded = set().union(*(names for _, _, names in parts))
    coords = job.grid.coords(rank)
    opt = optimizer([q for _, q in named])
    sched = _pipeline_schedule([(c, m) for c, m, _ in parts], job, mesh, ctx.device) \
        if p.pp > 1 else None
    d, dp = job.grid.coord(rank, "dp"), p.dp
    losses: list[float | None] = []
    norms: list[float] = []  # each step's global gradient norm, before clipping
    times: list[float] = []
    kinds = None
    profile_step = s.get("profile_step")

    def train_step(step: int, x, y):
        recorder.active = True
        if sched is None:
            loss = data_step(parts[0][1], x, y, p.num_microbatches, p.tp,
                             label=lambda phase: recorder.label(step, phase))
        else:
            recorder.label(step, "pipeline")
            mb_losses: list = []
            args = (x,) if 0 in chunks else ()
            kwargs = {"target": y, "losses": mb_losses} if p.num_stages - 1 in chunks else {}
            with loss_context(p.tp):
                sched.step(*args, **kwargs)
            loss = _mean(mb_losses) if mb_losses else None
        recorder.label(step, "opt")
        with torch.profiler.record_function(OPT_RANGE):
            replicate_partial_grads([q for _, q in named])
            norms.append((clip if experts is None else experts.clip)(named, coords, sharded,
                                                                     norm_group))
            opt.step()
            opt.zero_grad()
        recorder.active = False
        return loss

    for step in range(s["steps"]):
        ctx.reporter.set_phase("measure", step)
        x, y = step_batch(job, s["seed"], step)
        n = x.shape[0] // dp
        x, y = x[d * n:(d + 1) * n], y[d * n:(d + 1) * n]
        if p.cp > 1:  # the sequence positions this CP rank holds (executor/conformance/ring.py)
            from executor.conformance.ring import shard

            x, y = (shard(t, p.cp, coords["cp"], p.cp_load_balance, dim=1) for t in (x, y))
        prof = profiler() if step == profile_step else contextlib.nullcontext()
        with prof:
            t0 = time.perf_counter()
            losses.append(train_step(step, x, y))
            times.append(time.perf_counter() - t0)
        if step == profile_step:
            kinds = profile_kinds(prof, times[-1])
    ctx.reporter.set_phase("writing")
    dist.barrier()
    out = result_path(ctx.run_dir, rank)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, {"rank": rank, "chunks": chunks, "losses": losses,
                     "calls": recorder.to_dicts(), "step_times_s": times, "grad_norms": norms,
                     "profile_step": profile_step, "profile": kinds}, indent=None)


def _norm_group(job, rank: int):
    """The gradient-norm group the schedule names (tp-pp, plus dp under ZeRO/FSDP), or None."""
    import torch.distributed as dist

    dims = ["tp", "pp"] + ((["dp", "cp"] if job.parallel.cp > 1 else ["dp"])
                           if job.parallel.zero_stage >= 1 else [])
    mine = None
    for ranks in job.grid.groups(dims):  # every rank creates every group, in the same order
        if len(ranks) > 1:
            pg = dist.new_group(list(ranks))
            mine = pg if rank in ranks else mine
    return mine


def _plain_name(name: str) -> str:
    """A parameter name without DDP's ``module.`` prefix."""
    return name[len("module."):] if name.startswith("module.") else name


def _mean(losses: list) -> float:
    from executor.conformance.train import local_value

    return sum(local_value(v) for v in losses) / len(losses)


def main() -> None:
    """Run executor.rank's process body with the conformance task registered."""
    import executor.rank as base

    base.TASKS[TASK] = "executor.conformance.rank:conformance_task"
    base.main()


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
