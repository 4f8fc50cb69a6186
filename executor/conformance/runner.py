"""Run one conformance check: spawn the ranks, then join their record with the schedule.

``conform`` returns a plain dict (what ``format=json`` prints): per rank the IR's and
PyTorch's inventories of the compared step, the differences (unexplained) and the
documented ones, PyTorch's extra calls in the warm-up steps, and the losses of the
parallel run against the single-process reference.
"""

from __future__ import annotations

import json
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


def prepare(job: Job, run_dir: Path, steps: int, seed: int, timeout_s: float, threads: int) -> Path:
    """Write RUN_DIR/run.json for the ranks (executor.rank's settings plus the job)."""
    run_dir = rundir.prepare(run_dir, "conformance")
    rundir.write_json(run_dir / rundir.SETTINGS, {
        "task": TASK, "world_size": job.grid.world_size, "backend": "gloo", "threads": threads,
        "timeout_s": timeout_s, "comm_timeout_s": timeout_s, "job": job_to_dict(job),
        "steps": steps, "seed": seed})
    return run_dir


def _rows(job: Job, rank: int, ir: dict, pt: dict) -> list[dict]:
    return [{"group": list(k[0]), "group_name": group_name(job, rank, k[0], k[1]), "kind": k[1],
             "ir_count": ir.get(k, (0, 0))[0], "ir_bytes": ir.get(k, (0, 0))[1],
             "torch_count": pt.get(k, (0, 0))[0], "torch_bytes": pt.get(k, (0, 0))[1]}
            for k in sorted(set(ir) | set(pt))]


def parallel_losses(job: Job, results: dict[int, dict]) -> list[float]:
    """Per step, the mean loss over DP replicas, read from one rank per replica that has it."""
    grid, steps = job.grid, len(next(iter(results.values()))["losses"])
    out = []
    for step in range(steps):
        vals = [res["losses"][step] for r, res in sorted(results.items())
                if grid.coord(r, "tp") == 0 and res["losses"][step] is not None]
        if len(vals) != job.parallel.dp:
            raise RuntimeError(f"step {step}: {len(vals)} ranks reported a loss, expected one "
                               f"per DP replica ({job.parallel.dp})")
        out.append(sum(vals) / len(vals))
    return out


def conform(job: Job, run_dir: str | Path, *, steps: int = 3, seed: int = 0,
            timeout_s: float = 120.0, threads: int = 1, rtol: float = 1e-5,
            log: Callable[[str], None] = print) -> dict:
    """Train the plan with PyTorch's APIs, record its calls, compare with the schedule."""
    from executor.launch import launch_local

    run_dir = prepare(job, Path(run_dir), steps, seed, timeout_s, threads)
    world = job.grid.world_size
    launched = launch_local(run_dir, world, timeout_s=timeout_s, threads=threads, entry=ENTRY,
                            log=log)
    results = {r: json.loads(result_path(run_dir, r).read_text()) for r in range(world)}
    schedule = build_schedule(job)
    step = steps - 1  # the steady state: lazy initialisation and DDP's bucket rebuild are over
    ranks, diffs, warmup = {}, [], []
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
                    warmup.append({"rank": r, "step": s, "group": list(k[0]), "kind": k[1],
                                   "count": early.get(k, (0, 0))[0], "bytes": early.get(k, (0, 0))[1],
                                   "steady_count": last.get(k, (0, 0))[0]})
    ref = reference_losses(job, seed, steps)
    par = parallel_losses(job, results)
    errs = [relative_error(a, b) for a, b in zip(par, ref)]
    used = {d.rule for d in diffs if d.rule}
    return {
        "plan": _plan_line(job), "world_size": world, "compared_step": step, "steps": steps,
        "ranks": {str(r): rows for r, rows in ranks.items()},
        "differences": [to_dict(d) for d in diffs if not d.rule],
        "documented": [to_dict(d) for d in diffs if d.rule],
        "rules": {r.id: r.text for r in RULES if r.id in used},
        "warmup_extras": warmup,
        "losses": {"parallel": par, "reference": ref, "relative_error": errs, "rtol": rtol,
                   "match": all(e <= rtol for e in errs)},
        "run_dir": str(run_dir), "wall_s": round(launched.wall_s, 2),
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
        parts.append(p.pp_schedule + (f" v={p.pp_virtual_stages}" if p.pp_virtual_stages > 1 else "")
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
    lines.append("losses (parallel vs single process): " + ", ".join(
        f"{a:.7f} vs {b:.7f} ({e:.1e})" for a, b, e in zip(lo["parallel"], lo["reference"],
                                                         lo["relative_error"]))
                 + f" -> {'match' if lo['match'] else 'MISMATCH'} at rtol {lo['rtol']:g}")
    lines.append(f"run directory: {res['run_dir']} ({res['wall_s']} s)")
    return "\n".join(lines)
