"""What a MoE rank's memory adds to the dense model's (twin/workload/memory.py counts a MoE
layer as a dense one): expert states sharded over their own group, routed activations,
all-to-all buffers.

- Model states: the rank's routed experts are E/ep experts of f_e/etp (``stage_params``);
  on their own groups (ep > 1 or etp != tp) ZeRO shards their optimizer states (ZeRO-1),
  gradients (ZeRO-2) over the expert-data-parallel group of edp ranks, not over dp.
- Activations per MoE layer and micro-batch, in place of the dense MLP's m+1 tensors of
  b s f/t (Korthikanti Table 2's MLP share) when nothing or only attention is recomputed:
  the router's fp32 probabilities (n E 4 B), the routed copies before dispatch and after
  the experts (2 n k h e: the permuted input and the output the weighted combine needs),
  the R' gathered rows the experts read (R' h e) and their intermediates ((m+1) R' f_e/etp
  e: gate, up and product for SwiGLU), and the shared experts' (m+1) b s (s f_e)/t e. Full
  recomputation keeps the layer input only, as for a dense layer.
- Buffers: the largest dispatch's send and receive buffers ((n k + R) h e), live while
  the all-to-all runs.
"""

from __future__ import annotations

from collections.abc import Callable

from twin.spec import Job, ModelSpec, ParallelPlan
from twin.spec.experts import expert_grid, has_expert_groups
from twin.workload.moe import traffic
from twin.workload.params import expert_params, stage_params


def expert_state_delta(job: Job, stage: int, states: Callable) -> dict[str, float]:
    """Model-state bytes (params, grads, optimizer) to add to the dense count of a rank of
    ``stage``: its routed experts sharded by ZeRO-1/2 over edp instead of dp."""
    model, par = job.model, job.parallel
    out = dict.fromkeys(("params", "grads", "optimizer"), 0.0)
    if not has_expert_groups(model, par) or par.zero_stage not in (1, 2):
        return out
    layers = [i for i in job.layers_on_stage(stage) if model.moe.is_moe_layer(i)]
    experts = len(layers) * expert_params(model, par.ep, par.expert_tp)
    edp = expert_grid(job.grid, par).edp
    on_edp = states(experts, edp, par.zero_stage, model.dtype, par.optimizer_dtype)
    on_dp = states(experts, par.shard_degree, par.zero_stage, model.dtype, par.optimizer_dtype)
    return {cat: getattr(on_edp, cat) - getattr(on_dp, cat) for cat in out}


def optimizer_params(job: Job, stage: int) -> int:
    """Parameters whose optimizer step a rank of ``stage`` runs: all of its own under DDP;
    under ZeRO its 1/dp share, the routed experts' share 1/edp on their own groups."""
    par = job.parallel
    params = stage_params(job, stage)
    if par.zero_stage < 1:
        return params
    if not has_expert_groups(job.model, par):
        return -(-params // par.shard_degree)
    moe = job.model.moe
    layers = [i for i in job.layers_on_stage(stage) if moe.is_moe_layer(i)]
    experts = len(layers) * expert_params(job.model, par.ep, par.expert_tp)
    edp = expert_grid(job.grid, par).edp
    return -(-(params - experts) // par.shard_degree) + -(-experts // edp)


def moe_memory_delta(job: Job, rank: int, recompute: str, inflight: float,
                     states: Callable) -> dict[str, float]:
    """Bytes to add to the dense count of ``rank``'s memory by category (params, grads,
    optimizer, activations, buffers); ``states``: memory.model_state_bytes; ``inflight``:
    the micro-batches whose activations the rank holds at its peak."""
    model, par = job.model, job.parallel
    moe = model.moe
    out = dict.fromkeys(("params", "grads", "optimizer", "activations", "buffers"), 0.0)
    if moe is None:
        return out
    grid = expert_grid(job.grid, par)
    stage = job.grid.coord(rank, "pp")
    layers = [i for i in job.layers_on_stage(stage) if moe.is_moe_layer(i)]
    if not layers:
        return out
    out.update(expert_state_delta(job, stage, states))
    e, h = model.dtype_bytes, model.hidden_size
    tokens = par.micro_batch_size * model.seq_len
    n = tokens // par.tp if par.sp else tokens
    replicated = par.tp > 1 and not par.sp
    acts, biggest = 0.0, 0.0
    for layer in layers:
        t = traffic(moe, layer, n, par.ep, grid.coords(rank)["ep"])
        r = t.received * (par.expert_tp if par.expert_tp > 1 and not replicated else 1)
        biggest = max(biggest, (t.sent + t.received) * h * e)
        acts += layer_activation_delta(model, par, recompute, r)
    out["activations"] = acts * inflight
    out["buffers"] = biggest if par.ep > 1 else 0.0
    return out


def layer_activation_delta(model: ModelSpec, par: ParallelPlan, recompute: str,
                           rows: int) -> float:
    """Bytes one MoE layer keeps for backward per micro-batch beyond the dense layer's
    count (see the module docstring), its experts reading ``rows`` gathered tokens; 0 under
    full (or torchtitan's op-level) recomputation."""
    if recompute not in ("none", "selective"):
        return 0.0
    moe, e, h = model.moe, model.dtype_bytes, model.hidden_size
    tokens = par.micro_batch_size * model.seq_len
    n = tokens // par.tp if par.sp else tokens
    m = 2 if model.activation == "swiglu" else 1
    dense_mlp = (m + 1) * e * tokens * (model.ffn_hidden_size // par.tp)
    mlp = 4 * n * moe.num_experts + 2 * n * moe.experts_per_token * h * e + rows * h * e + \
        (m + 1) * rows * (moe.moe_ffn_hidden_size // par.expert_tp) * e + \
        (m + 1) * e * tokens * (moe.shared_ffn_hidden_size // par.tp)
    return float(mlp - dense_mlp)
