"""A MoE rank's closed-form FLOPs and traffic per step (for `paratwin inspect`): what its
MoE layers change against the dense layer the dense formulas count.

Per MoE layer and micro-batch, on a rank routing n tokens (b*s, or b*s/t under SP) that
receives R routed copies (R' = R * etp after the ETP all-gather), twin/schedule/moe.py:

- FLOPs (forward, backward twice): router 2nhE, experts 2R'(m+1)h f_e/etp, shared experts
  2 b s (m+1) h s f_e / t, in place of the dense MLP's 2 b s (m+1) h f / t;
- ep: four all-to-alls (dispatch, combine, and their backward), each the members' mean send
  buffer: the copies routed (n k, fewer with a capacity) x h x bytes;
- etp: an all-gather and a reduce-scatter of R' h bytes forward, the same backward;
- tp: the MLP's two SP all-gathers and reduce-scatters (or all-reduces) per layer only with
  shared experts; with tokens replicated over TP (no SP) the routed output's all-reduce;
- edp: the experts' gradient all-reduce (ZeRO-1/2: reduce-scatter and all-gather) over the
  expert-data-parallel group, taken out of dp's.
Full recomputation repeats each forward collective once.
"""

from __future__ import annotations

from twin.spec import Job
from twin.spec.experts import expert_grid, has_expert_groups
from twin.workload.comm import GroupTraffic, step_traffic
from twin.workload.moe import traffic
from twin.workload.params import expert_params, fp8_tp_gather


def _moe_layers(job: Job, stage: int) -> list[int]:
    moe = job.model.moe
    return [i for i in job.layers_on_stage(stage) if moe.is_moe_layer(i)]


def _shape(job: Job, rank: int):
    model, par = job.model, job.parallel
    grid = expert_grid(job.grid, par)
    tokens = par.micro_batch_size * model.seq_len
    n = tokens // par.tp if par.sp else tokens
    replicated = par.tp > 1 and not par.sp
    return grid, tokens, n, replicated


def moe_flops_delta(job: Job, rank: int) -> float:
    """Hardware FLOPs per step a MoE rank executes beyond the dense-MLP count (negative when
    its experts do less than the dense MLP it replaces)."""
    model, par = job.model, job.parallel
    moe = model.moe
    if moe is None:
        return 0.0
    grid, tokens, n, replicated = _shape(job, rank)
    etp, h = par.expert_tp, model.hidden_size
    m = 2 if model.activation == "swiglu" else 1
    passes = 3 + (1 if par.recompute == "full" else 0)  # forward, backward 2x, recomputed
    dense = 2 * tokens * (m + 1) * h * (model.ffn_hidden_size // par.tp)
    # a full recomputation that stops early re-runs the whole MoE MLP (its weighted combine
    # saves the last tensor) where the dense count leaves out fc2
    early = 2 * tokens * model.ffn_hidden_size * h // par.tp \
        if par.recompute == "full" and par.recompute_early_stop else 0
    total = 0.0
    for layer in _moe_layers(job, grid.grid.coord(rank, "pp")):
        t = traffic(moe, layer, n, par.ep, grid.coords(rank)["ep"])
        r = t.received * (etp if etp > 1 and not replicated else 1)
        mlp = 2 * n * h * moe.num_experts + 2 * r * (m + 1) * h * (moe.moe_ffn_hidden_size // etp)
        mlp += 2 * tokens * (m + 1) * h * (moe.shared_ffn_hidden_size // par.tp)
        total += passes * (mlp - dense) + early
    return total * par.num_microbatches


def moe_step_traffic(job: Job, rank: int) -> dict[str, GroupTraffic]:
    """``step_traffic`` of ``rank`` with its MoE layers' groups (ep, etp, edp) and their
    changes to tp and dp (see the module docstring)."""
    out = step_traffic(job, rank)
    model, par = job.model, job.parallel
    moe = model.moe
    if moe is None:
        return out
    grid, tokens, n, replicated = _shape(job, rank)
    stage = grid.grid.coord(rank, "pp")
    layers = _moe_layers(job, stage)
    mb, e, h = par.num_microbatches, model.dtype_bytes, model.hidden_size
    fwd = 2 if par.recompute == "full" else 1  # forward collectives (recomputed once more)
    bsh = tokens * h * e
    if "tp" in out and fwd == 2 and par.recompute_early_stop:  # the dense count stopped
        # before fc2's reduction; a MoE layer's recomputation runs whole (its MLP's included)
        out["tp"].add("reduce_scatter" if par.sp else "all_reduce", len(layers) * mb, bsh)
    if "tp" in out and not moe.shared_experts:  # the MLP's TP collectives are gone
        calls = out["tp"].calls
        for kind in (("all_gather", "reduce_scatter") if par.sp else ("all_reduce",)):
            per = 1 + fwd  # forward (and recomputed) and backward, each once per layer
            calls[kind][0] -= len(layers) * mb * per
            fp8 = kind == "all_gather" and fp8_tp_gather(par)  # the forward's in FP8
            calls[kind][1] -= len(layers) * mb * (fwd * bsh / e + bsh if fp8 else per * bsh)
    if replicated and par.tp > 1:  # the routed output all-reduced forward, its input backward
        out["tp"].add("all_reduce", len(layers) * mb * (fwd + 1), bsh)
    if par.ep > 1:
        ep = out.setdefault("ep", GroupTraffic("ep", par.ep))
        etp = out.setdefault("etp", GroupTraffic("etp", par.expert_tp))
        for layer in layers:
            t = traffic(moe, layer, n, par.ep, grid.coords(rank)["ep"])
            ep.add("all_to_all", mb * 2 * (fwd + 1), t.sent * h * e)
            if par.expert_tp > 1 and not replicated:
                rows = t.received * par.expert_tp
                etp.add("all_gather", mb * (fwd + 1), rows * h * e)
                etp.add("reduce_scatter", mb * (fwd + 1), rows * h * e)
    elif par.expert_tp > 1 and not replicated:
        etp = out.setdefault("etp", GroupTraffic("etp", par.expert_tp))
        for _ in layers:
            rows = n * moe.experts_per_token * par.expert_tp
            etp.add("all_gather", mb * (fwd + 1), rows * h * e)
            etp.add("reduce_scatter", mb * (fwd + 1), rows * h * e)
    if "etp" in out and not out["etp"].calls:
        del out["etp"]
    if has_expert_groups(model, par) and layers and "dp" in out:
        experts = len(layers) * expert_params(model, par.ep, par.expert_tp) * e
        for c in out["dp"].calls.values():
            c[1] -= c[0] * experts
        if grid.edp > 1:
            edp = out["edp"] = GroupTraffic("edp", grid.edp)
            syncs = mb if par.sync_every_microbatch else 1
            if par.zero_stage == 0:
                edp.add("all_reduce", syncs, experts)
            else:
                edp.add("reduce_scatter", syncs, experts)
                edp.add("all_gather", 1, experts)
    return out
