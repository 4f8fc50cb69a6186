"""How a search's result reads: plan labels, the ranked table, and why nothing fits.

The result is the dict `paratwin search` prints with ``format=json`` (``plans``: ranked,
each with its ``parallel`` fields, ``gpus``, ``step_time_s``, ``tokens_per_s``, ``mfu``,
``peak_memory_bytes``, ``exposed_comm_s``, ``bubble_fraction`` and ``estimate``).
"""

from __future__ import annotations

import dataclasses

from twin.search.space import SearchSpace, legal_tp
from twin.spec import ModelSpec, ParallelPlan

PLAN_KEYS = ("dp", "tp", "pp", "sp", "zero_stage", "fsdp_reshard_after_forward",
             "micro_batch_size", "global_batch_size", "pp_schedule", "pp_virtual_stages",
             "recompute", "rank_order", "ep", "etp", "cp", "dp_replicate")


def plan_fields(plan: ParallelPlan) -> dict:
    """Every field of the plan (JSON-ready)."""
    out = dataclasses.asdict(plan)
    if out.get("pp_stage_layers") is not None:
        out["pp_stage_layers"] = list(out["pp_stage_layers"])
    return out


def plan_label(p: dict | ParallelPlan) -> str:
    """'tp4 pp2 cp2 dp128 ep8 etp1 hsdp16 sp interleaved v4 mb1 rc=full [tp-cp-dp-pp]'
    (degrees > 1; etp when it is not tp; hsdpN: N replicas of FSDP)."""
    p = plan_fields(p) if isinstance(p, ParallelPlan) else p
    parts = [f"{k}{p[k]}" for k in ("tp", "pp", "cp", "dp", "ep") if p.get(k, 1) > 1] \
        or ["single"]
    if p.get("etp") is not None and p["etp"] != p["tp"]:
        parts.append(f"etp{p['etp']}")
    if p["zero_stage"]:
        parts.append(("fsdp" if p["fsdp_reshard_after_forward"] else "fsdp-keep")
                     if p["zero_stage"] == 3 else f"zero{p['zero_stage']}")
    if p.get("dp_replicate", 1) > 1:
        parts.append(f"hsdp{p['dp_replicate']}")
    if p["sp"]:
        parts.append("sp")
    if p["pp"] > 1:
        parts.append(p["pp_schedule"] + (f" v{p['pp_virtual_stages']}"
                                         if p["pp_virtual_stages"] > 1 else ""))
    parts.append(f"mb{p['micro_batch_size']}")
    if p["recompute"] != "none":
        parts.append(f"rc={p['recompute']}")
    if p["rank_order"] != "tp-cp-pp-dp":
        parts.append(f"[{p['rank_order']}]")
    return " ".join(parts)


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f}"


def format_table(result: dict) -> str:
    """The ranked table (simulated plans by the twin's step time, then by the estimate)."""
    head = (f"{'#':>3} {'GPUs':>5}  {'plan':<62} {'step s':>8} {'tokens/s':>10} {'MFU':>6} "
            f"{'peak GB':>7} {'bubble':>6}  {'est s':>8}  exposed comm s")
    lines = [head]
    for k, row in enumerate(result["plans"], start=1):
        comm = ", ".join(f"{g} {v:.3g}" for g, v in sorted(row["exposed_comm_s"].items())
                         if v >= 5e-4) or "-"
        est = row["estimate"]["step_time_s"]
        label = plan_label(row["parallel"])
        mark = "*" if row.get("pareto") else " "
        lines.append(f"{k:>3} {row['gpus']:>5}{mark} {label[:62]:<62} {row['step_time_s']:>8.3f} "
                     f"{row['tokens_per_s']:>10,.0f} {row['mfu']:>6.1%} "
                     f"{_gb(row['peak_memory_bytes']):>7} {row['bubble_fraction']:>6.1%}  "
                     f"{est:>8.3f}  {comm}")
    return "\n".join(lines)


def no_fit_message(model: ModelSpec, space: SearchSpace, hbm_bytes: float,
                   smallest: tuple[float, ParallelPlan, int] | None) -> str:
    """One line: nothing fits, the smallest memory found, and the field to change."""
    if smallest is None:
        return "no legal plan in the search space; widen space.* or change gpus"
    peak, plan, gpus = smallest
    fix = []
    friendly = {"tp": max(legal_tp(model, max(space.gpus))), "recompute": "full",
                "zero_stage": 3, "micro_batch_size": 1, "sp": True}
    for field, value in friendly.items():
        wanted = getattr(space, field)
        if wanted is not None and value not in wanted:
            fix.append(f"space.{field} (add {str(value).lower()})")
    if space.pp is not None and max(space.pp) < model.num_layers:
        fix.append("space.pp (allow more stages)")
    fix.append(f"more GPUs (gpus=[{max(space.gpus)},{4 * max(space.gpus)}] or cluster.num_nodes)")
    return (f"no plan fits in {_size(hbm_bytes)} per GPU: the smallest peak found is "
            f"{_size(peak)} ({plan_label(plan)} on {gpus} GPUs); try " + ", or ".join(fix))


def _size(nbytes: float) -> str:
    return f"{nbytes / 1e9:.3g} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.3g} MB"
