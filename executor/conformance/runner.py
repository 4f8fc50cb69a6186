"""Run one conformance check: spawn the ranks, then join their record with the schedule.

``conform`` returns a plain dict (what ``format=json`` prints): per rank the IR's and
PyTorch's inventories of the compared step, the differences (unexplained) and the
documented ones, PyTorch's extra calls in the warm-up steps, the losses of the
parallel run against the single-process reference, and the step times (``timing``: per
step the largest rank's wall time, median and p10-p90 over the steps after ``warmup``;
with ``profile=True`` the last step also runs under torch.profiler, is left out of the
times, and gives CPU seconds per op kind).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path

from executor.conformance.compare import RULES, compare, group_name, ir_entries, table, to_dict, torch_entries
from executor.conformance.rank import TASK, result_path
from executor.conformance.train import reference_losses, relative_error
from twin import rundir
from twin.schedule.builder import build_schedule
from twin.spec import Job
from twin.spec.io import job_to_dict

ENTRY = "executor.conformance.rank"


def prepare(job: Job, run_dir: Path, steps: int, seed: int, timeout_s: float, threads: int,
            profile_step: int | None = None) -> Path:
    """Write RUN_DIR/run.json for the ranks (executor.rank's settings plus the job)."""
    run_dir = rundir.prepare(run_dir, "conformance")
    rundir.write_json(run_dir / rundir.SETTINGS, {
        "task": TASK, "world_size": job.grid.world_size, "backend": "gloo", "threads": threads,
        "timeout_s": timeout_s, "comm_timeout_s": timeout_s, "job": job_to_dict(job),
        "steps": steps, "seed": seed, "profile_step": profile_step})
    return run_dir


def _quantile(times: list[float], p: float) -> float:
    """The nearest-rank quantile twin.metrics.summarize uses for the replay's p10/p90."""
    s = sorted(times)
    return s[min(len(s) - 1, max(0, round(p * (len(s) - 1))))]


def step_timing(step_times: dict[int, list[float]], warmup: int,
                profile_step: int | None = None, profiles: dict[int, dict] | None = None) -> dict:
    """The run's step times from each rank's own (no barrier between steps): per step the
    largest rank's, then median and p10-p90 over the steps after ``warmup`` (the profiled
    step left out). ``profiles``: per rank the profiled step's kinds, summed here."""
    n = min(len(t) for t in step_times.values())
    per_step = [max(t[i] for t in step_times.values()) for i in range(n)]
    keep = [i for i in range(warmup, n) if i != profile_step]
    if not keep:
        raise ValueError(f"no measured step: {n} steps, warmup {warmup}, profiled step "
                         f"{profile_step}")
    times = [per_step[i] for i in keep]
    out = {"warmup": warmup, "measured_steps": len(times), "steps_measured": keep,
           "step_times_s": times, "step_time_s": statistics.median(times),
           "step_time_p10_s": _quantile(times, 0.1), "step_time_p50_s": statistics.median(times),
           "step_time_p90_s": _quantile(times, 0.9),
           "per_rank_median_s": {str(r): statistics.median([t[i] for i in keep])
                                 for r, t in sorted(step_times.items())},
           "profile_step": profile_step, "profile": None}
    got = {r: p for r, p in (profiles or {}).items() if p}
    if got:
        kinds = {k: sum(p["kinds"].get(k, 0.0) for p in got.values())
                 for k in next(iter(got.values()))["kinds"]}
        out["profile"] = {"step_s": max(p["step_s"] for p in got.values()), "kinds": kinds,
                          "ranks": {str(r): p for r, p in sorted(got.items())}}
    return out


def _rows(job: Job, rank: int, ir: dict, pt: dict) -> list[dict]:
    return [{"group": list(k[0]), "group_name": group_name(job, rank, k[0], k[1]), "kind": k[1],
             "ir_count": ir.get(k, (0, 0))[0], "ir_bytes": ir.get(k, (0, 0))[1],
             "torch_count": pt.get(k, (0, 0))[0], "torch_bytes": pt.get(k, (0, 0))[1]}
            for k in sorted(set(ir) | set(pt))]


def parallel_losses(job: Job, results: dict[int, dict]) -> list[float]:
    """Per step, the mean loss over DP replicas (and CP ranks, each holding s/cp tokens), read
    from one rank per replica that has it."""
    grid, steps = job.grid, len(next(iter(results.values()))["losses"])
    out = []
    for step in range(steps):
        vals = [res["losses"][step] for r, res in sorted(results.items())
                if grid.coord(r, "tp") == 0 and res["losses"][step] is not None]
        if len(vals) != job.parallel.dp * job.parallel.cp:  # (CP ranks: equal token shares)
            raise RuntimeError(f"step {step}: {len(vals)} ranks reported a loss, expected one "
                               f"per DP replica and CP rank ({job.parallel.dp * job.parallel.cp})")
        out.append(sum(vals) / len(vals))
    return out


def conform(job: Job, run_dir: str | Path, *, steps: int = 3, seed: int = 0,
            timeout_s: float = 120.0, threads: int = 1, rtol: float = 1e-5,
            log: Callable[[str], None] = print, warmup: int = 1, profile: bool = False,
            reference: bool = True) -> dict:
    """Train the plan with PyTorch's APIs, record its calls, compare with the schedule.

    ``warmup``: steps left out of ``timing``; ``profile``: run the last step under
    torch.profiler (left out of the times); ``reference=False`` skips the single-process
    run (losses then hold the parallel ones only, ``match`` None)."""
    from executor.launch import launch_local

    profile_step = steps - 1 if profile else None
    if steps - warmup - (1 if profile else 0) < 1:
        raise ValueError(f"steps={steps} leaves no measured step after warmup={warmup}"
                         + (" and the profiled step" if profile else ""))
    run_dir = prepare(job, Path(run_dir), steps, seed, timeout_s, threads, profile_step)
    world = job.grid.world_size
    launched = launch_local(run_dir, world, timeout_s=timeout_s, threads=threads, entry=ENTRY,
                            log=log)
    results = {r: json.loads(result_path(run_dir, r).read_text()) for r in range(world)}
    schedule = build_schedule(job)
    step = steps - 1  # the steady state: lazy initialisation and DDP's bucket rebuild are over
    ranks, diffs, extras = {}, [], []
    for r in range(world):
        ir = ir_entries(schedule.program(r))
        got = torch_entries(results[r]["calls"], step, r)
        ranks[r] = _rows(job, r, table(ir), table(got))
        diffs += compare(job, r, ir, got)
        last = table(got)
        for s in range(step):
            early = table(torch_entries(results[r]["calls"], s, r))
            for k in sorted(set(early) | set(last)):
                if early.get(k) != last.get(k):
                    extras.append({"rank": r, "step": s, "group": list(k[0]), "kind": k[1],
                                   "count": early.get(k, (0, 0))[0], "bytes": early.get(k, (0, 0))[1],
                                   "steady_count": last.get(k, (0, 0))[0]})
    par = parallel_losses(job, results)
    ref = reference_losses(job, seed, steps) if reference else None
    errs = [relative_error(a, b) for a, b in zip(par, ref)] if reference else None
    used = {d.rule for d in diffs if d.rule}
    timing = step_timing({r: res.get("step_times_s", []) for r, res in results.items()}, warmup,
                         profile_step, {r: res.get("profile") for r, res in results.items()})
    return {
        "plan": _plan_line(job), "world_size": world, "compared_step": step, "steps": steps,
        "ranks": {str(r): rows for r, rows in ranks.items()},
        "differences": [to_dict(d) for d in diffs if not d.rule],
        "documented": [to_dict(d) for d in diffs if d.rule],
        "rules": {r.id: r.text for r in RULES if r.id in used},
        "warmup_extras": extras,
        "losses": {"parallel": par, "reference": ref, "relative_error": errs, "rtol": rtol,
                   "match": all(e <= rtol for e in errs) if reference else None},
        "run_dir": str(run_dir), "wall_s": round(launched.wall_s, 2), "timing": timing,
    }


def _plan_line(job: Job) -> str:
    p = job.parallel
    parts = [f"dp={p.dp}", f"tp={p.tp}", f"pp={p.pp}"]
    if p.dp > 1:
        parts.append("fsdp2" + ("" if p.fsdp_reshard_after_forward else " (no reshard)")
                     if p.zero_stage == 3 else "ddp")
    if p.tp > 1:
        parts.append("sp" if p.sp else "no sp")
    if p.pp > 1:
        parts.append((f"table {p.pp_schedule_csv}" if p.pp_schedule_csv else p.pp_schedule)
                     + (f" v={p.pp_virtual_stages}" if p.pp_virtual_stages > 1 else "")
                     + f" m={p.num_microbatches}")
    return f"{job.model.name}: " + ", ".join(parts)


def _b(n: int) -> str:
    return f"{n:,}"


def format_text(res: dict) -> str:
    """Both inventories side by side per rank, then the differences and the losses."""
    lines = [f"conformance of {res['plan']} ({res['world_size']} ranks, gloo); step "
             f"{res['compared_step']} of {res['steps']} compared", ""]
    head = f"{'group':<10} {'ranks':<12} {'kind':<15} {'IR n':>5} {'IR bytes':>12} " \
           f"{'torch n':>7} {'torch bytes':>12}"
    for r, rows in res["ranks"].items():
        lines += [f"rank {r}", head]
        for row in rows:
            same = row["ir_count"] == row["torch_count"] and row["ir_bytes"] == row["torch_bytes"]
            lines.append(f"{row['group_name']:<10} {','.join(map(str, row['group'])):<12} "
                         f"{row['kind']:<15} {row['ir_count']:>5} {_b(row['ir_bytes']):>12} "
                         f"{row['torch_count']:>7} {_b(row['torch_bytes']):>12}"
                         + ("" if same else "   <-"))
        if not rows:
            lines.append("(no communication)")
        lines.append("")
    for title, items in (("differences", res["differences"]), ("documented", res["documented"])):
        lines.append(f"{title}: {len(items) or 'none'}")
        for d in items:
            lines.append(f"  rank {d['rank']} {d['group_name']} {d['group']} {d['kind']}: {d['what']} "
                         f"(IR {d['ir_count']} calls {_b(d['ir_bytes'])} B, PyTorch "
                         f"{d['torch_count']} calls {_b(d['torch_bytes'])} B)"
                         + (f" [{d['rule']}]" if d["rule"] else "") + (f" {d['note']}" if d["note"] else ""))
    for rid, text in res["rules"].items():
        lines.append(f"  {rid}: {text}")
    if res["warmup_extras"]:
        lines.append(f"warm-up steps differ from the steady state in {len(res['warmup_extras'])} "
                     "(rank, group, kind) entries, e.g. "
                     + "; ".join(f"rank {w['rank']} step {w['step']} {w['kind']} on {w['group']}: "
                                 f"{w['count']} calls {_b(w['bytes'])} B vs {w['steady_count']}"
                                 for w in res["warmup_extras"][:3]))
    lo = res["losses"]
    if lo["reference"] is not None:
        lines.append("losses (parallel vs single process): " + ", ".join(
            f"{a:.7f} vs {b:.7f} ({e:.1e})" for a, b, e in zip(lo["parallel"], lo["reference"],
                                                             lo["relative_error"]))
                     + f" -> {'match' if lo['match'] else 'MISMATCH'} at rtol {lo['rtol']:g}")
    t = res.get("timing")
    if t:
        lines.append(f"step time (largest rank, no barrier): {t['step_time_s'] * 1e3:.1f} ms "
                     f"(p10-p90 {t['step_time_p10_s'] * 1e3:.1f}-{t['step_time_p90_s'] * 1e3:.1f})"
                     f" over {t['measured_steps']} steps after {t['warmup']} warm-up")
    lines.append(f"run directory: {res['run_dir']} ({res['wall_s']} s)")
    return "\n".join(lines)
