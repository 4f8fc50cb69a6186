"""`paratwin schedule`: dump one rank's program and summarise its ops and collectives."""

from __future__ import annotations

import json
import time
from pathlib import Path

from paratwin.config import job_from_cfg
from twin import rundir
from twin.files import write_text_atomic
from twin.schedule.builder import build_schedule
from twin.schedule.check import check_schedule
from twin.schedule.tables import job_tables
from twin.schedule.torchcsv import format_csv, parse_csv
from twin.spec import ConfigError


def _si(x: float) -> str:
    for div, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g} {prefix}"
    return f"{x:.3g} "


def format_program(program, summary: dict, head: int) -> str:
    lines = [f"rank {program.rank}: {summary['ops']} ops, {_si(summary['flops'])}FLOP of compute",
             "ops by kind: " + ", ".join(f"{k} {n}" for k, n in summary["by_kind"].items()), "",
             f"{'group':<12} {'kind':<15} {'count':>7} {'bytes':>12}"]
    for c in summary["collectives"]:
        lines.append(f"{c['group']:<12} {c['kind']:<15} {c['count']:>7} {_si(c['bytes']) + 'B':>12}")
    if not summary["collectives"]:
        lines.append("(no communication)")
    n = len(program.ops) if head < 0 else min(head, len(program.ops))
    if n:
        lines += ["", f"first {n} ops (index, stream, kind, name, deps, bytes, FLOPs):"]
        for i, op in enumerate(program.ops[:n]):
            lines.append(f"{i:>6} {op.stream:<9} {op.kind:<14} {op.name:<34} "
                         f"{list(op.deps)!s:<14} {_si(op.bytes)}B {_si(op.flops)}FLOP")
    return "\n".join(lines)


def write_torch_csv(cfg, job) -> dict:
    """format=torch-csv: every pipeline rank's action table in torch.distributed.pipelining's
    CSV format (twin/schedule/torchcsv.py), printed or written to ``out`` atomically. An
    existing ``out`` is replaced only when it already is such a table (or force=true)."""
    text = format_csv(job_tables(job))
    summary = {"format": "torch-csv", "rows": job.parallel.pp,
               "actions": sum(len(row) for row in parse_csv(text))}
    if not cfg.get("out"):
        print(text, end="")
        return summary
    out = Path(str(cfg.out))
    if out.is_dir():
        raise ConfigError(f"out={out} is a directory; give a file path for the table")
    if out.exists() and not cfg.get("force", False):
        try:
            parse_csv(out.read_text(encoding="utf-8"))
        except (ConfigError, UnicodeDecodeError):
            raise ConfigError(f"out={out} exists and is not a pipeline action table; it was not "
                              "overwritten: give another path, or force=true to replace it") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, text)
    summary["out"] = str(out)
    print(f"wrote {out}: {summary['rows']} ranks, {summary['actions']} actions")
    return summary


def run(cfg) -> dict:
    fmt = cfg.get("format", "text")
    if fmt not in ("text", "json", "torch-csv"):
        raise ConfigError(f"format={fmt!r} is not one of text|json|torch-csv")
    job = job_from_cfg(cfg)
    if fmt == "torch-csv":
        return write_torch_csv(cfg, job)
    rank = int(cfg.get("rank", 0))
    if not 0 <= rank < job.grid.world_size:
        raise ConfigError(f"rank={rank} is out of range for world size {job.grid.world_size}; "
                          f"use 0..{job.grid.world_size - 1}")
    schedule = build_schedule(job)
    t0 = time.perf_counter()
    program = schedule.program(rank)
    summary = program.summary()
    summary["build_s"] = time.perf_counter() - t0
    summary["coords"] = job.grid.coords(rank)
    if cfg.get("check"):
        if job.grid.world_size > 256:
            raise ConfigError(f"check=true builds every rank; world size {job.grid.world_size} "
                              "is too large (use a cluster of at most 256 GPUs)")
        summary["check"] = check_schedule(schedule.programs())
    if cfg.get("out"):
        out = rundir.check_replace(Path(str(cfg.out)), "schedule", bool(cfg.get("force", False)))
        out.parent.mkdir(parents=True, exist_ok=True)
        schedule.save(out, ranks=[rank])
        summary["out"] = str(out)
    if fmt == "json":
        print(json.dumps(summary, indent=2))
    else:
        print(format_program(program, summary, int(cfg.get("head", 40))))
        if "check" in summary:
            c = summary["check"]
            print(f"\nchecks passed over {c['ranks']} ranks: {c['ops']} ops, "
                  f"{c['collective_calls']} collective calls in order, {c['p2p_pairs']} send/recv "
                  "pairs, no deadlock")
        if "out" in summary:
            print(f"\nwrote {summary['out']}")
    return summary
