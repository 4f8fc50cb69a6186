"""The memory calculator behind `paratwin inspect`: one dict per job, and its text form."""

from __future__ import annotations

import dataclasses
import warnings

from twin.spec import ConfigError, Job, build_job
from twin.workload.flops import (
    layer_forward_flops,
    lm_head_gemm,
    model_flops_per_step,
    recompute_forward_flops,
)
from twin.workload.memory import rank_memory
from twin.workload.moerank import moe_flops_delta, moe_step_traffic
from twin.workload.params import active_params, kv_replicas, model_params, stage_params

RUNTIME = ("workspace", "comm_buffers", "cuda_context")
"""Memory categories of the CUDA runtime and libraries, shown as one column."""


def listed_ranks(job: Job) -> list[int]:
    """The first rank (dp=0, tp=0) of every pipeline stage; for legacy DP also a replica."""
    ranks = [job.grid.rank(pp=s) for s in range(job.parallel.pp)]
    if job.parallel.legacy_dp and job.parallel.dp > 1:
        ranks.append(job.grid.rank(dp=1))
    return ranks


def rank_flops_per_step(job: Job, rank: int) -> float:
    """Hardware FLOPs one rank executes per step (its layers, its share of the head)."""
    model, par = job.model, job.parallel
    stage = job.grid.coord(rank, "pp")
    b = par.micro_batch_size
    per_layer = 3 * layer_forward_flops(model, b, par.tp) + recompute_forward_flops(
        model, b, par.tp, par.recompute, par.flash_attention, par.recompute_early_stop)
    flops = len(job.layers_on_stage(stage)) * per_layer
    if stage == job.head_stage:
        flops += 3 * lm_head_gemm(model, b * model.seq_len, par.tp).flops
    return flops * par.num_microbatches + moe_flops_delta(job, rank)


def inspect_job(job: Job) -> dict:
    """Parameters, memory by category vs HBM, FLOPs and per-group traffic per listed rank."""
    model, cluster, par = job.model, job.cluster, job.parallel
    hbm = cluster.hbm_bytes
    ranks = []
    for rank in listed_ranks(job):
        stage = job.grid.coord(rank, "pp")
        mem = rank_memory(job, rank)
        layers = job.layers_on_stage(stage)
        ranks.append({
            "rank": rank,
            "stage": stage,
            "coords": job.grid.coords(rank),
            "node": job.grid.node(rank),
            "layers": [layers[0], layers[-1]] if layers else [],
            "params": stage_params(job, stage),
            "memory_bytes": mem.as_dict(),
            "fits_memory": mem.total <= hbm,
            "headroom_bytes": hbm - mem.total,
            "flops_per_step": rank_flops_per_step(job, rank),
            "groups": {k: g.as_dict() for k, g in moe_step_traffic(job, rank).items()},
        })
    return {
        "model": model.name,
        "cluster": cluster.name,
        "gpu": cluster.gpu.name,
        "world_size": job.grid.world_size,
        "num_nodes": cluster.num_nodes,
        "plan": {"dp": par.dp, "tp": par.tp, "pp": par.pp, "sp": par.sp,
                 "zero_stage": par.zero_stage, "legacy_dp": par.legacy_dp,
                 "dp_replicate": par.dp_replicate, "dp_shard": par.shard_degree,
                 "pp_schedule": (f"csv {par.pp_schedule_csv}" if par.pp_schedule_csv
                                 else par.pp_schedule) if par.pp > 1 else None,
                 "pp_virtual_stages": par.pp_virtual_stages, "recompute": par.recompute,
                 "flash_attention": par.flash_attention,
                 "micro_batch_size": par.micro_batch_size,
                 "global_batch_size": par.global_batch_size,
                 "num_microbatches": par.num_microbatches,
                 **({"cp": par.cp, "cp_method": par.cp_method,
                     "cp_load_balance": par.cp_load_balance} if par.cp > 1 else {})},
        "params_total": model_params(model),
        "params_active": active_params(model),
        "tokens_per_step": par.global_batch_size * model.seq_len,
        "flops_per_step": model_flops_per_step(model, par.global_batch_size),
        "hardware_flops_per_step": sum(
            rank_flops_per_step(job, job.grid.rank(pp=s)) for s in range(par.pp))
        * par.dp * par.tp,
        "kv_replicas": kv_replicas(model, par.tp),
        "hbm_bytes": hbm,
        "fits_memory": all(r["fits_memory"] for r in ranks),
        "ranks": ranks,
    }


def _peak(job: Job) -> float:
    return max(rank_memory(job, r).total for r in listed_ranks(job))


def _changes(job: Job) -> list[dict]:
    """The single plan changes that lower memory, cheapest in time first: SP under TP (the
    same work), sharding more state over DP, selective recomputation, half the micro-batch
    (twice the micro-batches), full recomputation."""
    par = job.parallel
    out: list[dict] = []
    if par.tp > 1 and not par.sp:
        out.append({"sp": True})
    if par.dp > 1 and not par.legacy_dp:
        out += [{"zero_stage": z} for z in range(par.zero_stage + 1, 4)]
    if par.recompute == "none":
        out.append({"recompute": "selective"})
    if par.micro_batch_size > 1:
        out.append({"micro_batch_size": par.micro_batch_size // 2})
    if par.recompute != "full":
        out.append({"recompute": "full"})
    return out


def memory_fixes(job: Job) -> list[dict]:
    """For a plan that does not fit: each single change of its plan (``_changes``) that
    fits, with the peak it leaves (``{"changes": {"parallel.FIELD": value},
    "peak_memory_bytes": ...}``, in that order; of the ZeRO stages the lowest that fits);
    when none does, all of them together, with ``fits`` saying whether that is enough.
    Changes the job cannot take (build_job) are left out. Empty when the plan fits or
    nothing can be changed."""
    hbm = job.cluster.hbm_bytes
    if _peak(job) <= hbm:
        return []
    changes = _changes(job)

    def peak_with(change: dict) -> float | None:
        try:
            with warnings.catch_warnings():  # the user's plan was warned about already
                warnings.simplefilter("ignore")
                return _peak(build_job(job.model, job.cluster,
                                       dataclasses.replace(job.parallel, **change)))
        except ConfigError:
            return None

    def row(change: dict, peak: float) -> dict:
        return {"changes": {f"parallel.{k}": v for k, v in change.items()},
                "peak_memory_bytes": peak, "fits": peak <= hbm}

    legal = [(c, peak) for c in changes if (peak := peak_with(c)) is not None]
    fits, fields = [], set()
    for c, peak in legal:  # of the ZeRO stages that fit, the lowest (the least traffic)
        if peak <= hbm and not ("zero_stage" in c and "zero_stage" in fields):
            fits.append(row(c, peak))
            fields.update(c)
    if fits or not legal:
        return fits
    together: dict = {}
    for c, _ in legal:  # the last value of a field wins (zero_stage 3, recompute full)
        together.update(c)
    peak = peak_with(together)
    return [] if peak is None else [row(together, peak)]


def _fix_text(fixes: list[dict]) -> str:
    def label(f: dict) -> str:
        return " ".join(f"{k}={str(v).lower()}" for k, v in f["changes"].items()) \
            + f" ({f['peak_memory_bytes'] / 1e9:.2f} GB)"

    if not fixes:
        return "no change of recompute, sp, zero_stage or micro_batch_size fits: more GPUs, or " \
            "more tp or pp (`paratwin search` ranks every plan that fits)"
    if fixes[0]["fits"]:
        return "fits with " + ", or ".join(label(f) for f in fixes)
    which = "all together" if len(fixes[0]["changes"]) > 1 else "at best"
    return f"no change fits; {which}: {label(fixes[0])}, still over: more GPUs, or more tp or " \
        "pp (`paratwin search` ranks every plan that fits)"


def _si(x: float, unit: str = "") -> str:
    for div, prefix in ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g} {prefix}{unit}".rstrip()
    return f"{x:.3g} {unit}".rstrip()


def _scaled(x: float, div: float) -> str:
    return f"{x / div:.2f}"


def format_inspect(rep: dict) -> str:
    """Human-readable tables of an ``inspect_job`` report."""
    p = rep["plan"]
    biggest = max(r["memory_bytes"]["total"] for r in rep["ranks"])
    unit, div = ("GB", 1e9) if biggest >= 1e9 else ("MB", 1e6)
    kind = ("legacy DP" if p["legacy_dp"] else
            ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3/FSDP"][p["zero_stage"]])
    pipe = (f" pp={p['pp']} ({p['pp_schedule']}"
            + (f", v={p['pp_virtual_stages']}" if p["pp_virtual_stages"] > 1 else "") + ")"
            if p["pp"] > 1 else "")
    lines = [
        f"{rep['model']} on {rep['cluster']}: {rep['num_nodes']} node(s), {rep['world_size']} x "
        f"{rep['gpu']} ({rep['hbm_bytes'] / 1e9:.0f} GB)",
        f"plan: dp={p['dp']} ({kind}) tp={p['tp']}{' +sp' if p['sp'] else ''}{pipe}"
        + (f" cp={p['cp']} ({p['cp_method']}, {p['cp_load_balance']})" if "cp" in p else "") + "; "
        f"recompute={p['recompute']}, {'flash' if p['flash_attention'] else 'eager'} attention",
        f"batch: {p['global_batch_size']} sequences = {p['num_microbatches']} micro-batch(es) of "
        f"{p['micro_batch_size']} per DP rank; {_si(rep['tokens_per_step'])} tokens/step",
        f"params: {_si(rep['params_total'])}"
        + (f" ({_si(rep['params_active'])} active)"
           if rep.get("params_active", rep["params_total"]) != rep["params_total"] else "")
        + "   model FLOPs/step: "
        f"{_si(rep['flops_per_step'], 'FLOP')}   hardware FLOPs/step: "
        f"{_si(rep['hardware_flops_per_step'], 'FLOP')}"
        + (f"   KV heads replicated x{rep['kv_replicas']} under TP"
           if rep["kv_replicas"] > 1 else ""),
        "",
        f"memory per rank ({unit})",
        f"{'rank':>5} {'stage':>5} {'layers':>9} {'params':>9} {'weights':>8} {'grads':>7} "
        f"{'optim':>7} {'activ':>7} {'buffers':>8} {'temp':>7} {'reserve':>8} {'runtime':>8} "
        f"{'total':>8} {'HBM':>8}  fits",
    ]
    for r in rep["ranks"]:
        m = r["memory_bytes"]
        layers = f"{r['layers'][0]}-{r['layers'][1]}" if r["layers"] else "-"
        verdict = ("yes" if r["fits_memory"] else "NO") + \
            f" ({'+' if r['headroom_bytes'] >= 0 else ''}{r['headroom_bytes'] / 1e9:.2f} GB)"
        lines.append(
            f"{r['rank']:>5} {r['stage']:>5} {layers:>9} {_si(r['params']):>9} "
            f"{_scaled(m['params'], div):>8} {_scaled(m['grads'], div):>7} "
            f"{_scaled(m['optimizer'], div):>7} {_scaled(m['activations'], div):>7} "
            f"{_scaled(m['buffers'], div):>8} {_scaled(m.get('temporary', 0.0), div):>7} "
            f"{_scaled(m.get('allocator_reserve', 0.0), div):>8} "
            f"{_scaled(sum(m.get(k, 0.0) for k in RUNTIME), div):>8} "
            f"{_scaled(m['total'], div):>8} {rep['hbm_bytes'] / div:>8.0f}  {verdict}")
    lines += ["temp: the largest transient (loss in fp32, attention, a recomputed layer); "
              "reserve: the caching allocator's reserved-but-free bytes; runtime: cuBLAS "
              "workspaces, NCCL buffers and the CUDA context"]
    lines += ["", "traffic per step (payload bytes by nccl-tests' convention; wire = sent by the rank)"]
    for r in rep["ranks"]:
        lines.append(f"  rank {r['rank']} (stage {r['stage']}), "
                     f"{_si(r['flops_per_step'], 'FLOP')} executed:")
        if not r["groups"]:
            lines.append("    no communication")
        for name, g in r["groups"].items():
            calls = ", ".join(f"{c['kind']} {c['count']:g} x {_si(c['bytes'] / c['count'], 'B')}"
                              for c in g["collectives"])
            lines.append(f"    {name}({g['size']}): {_si(g['bytes'], 'B')} payload, "
                         f"{_si(g['wire_bytes'], 'B')} wire: {calls}")
    lines.append("")
    lines.append("fits in memory: " + ("yes" if rep["fits_memory"] else
                                       "NO - see the ranks marked NO above"))
    if "fixes" in rep:
        lines.append("  " + _fix_text(rep["fixes"]))
    return "\n".join(lines)
