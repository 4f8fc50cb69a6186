"""Memory per rank by category: model states (per ZeRO stage) and activations (Korthikanti).

Model states: Rajbhandari et al. 2020 (ZeRO), §3.1 and §5: mixed-precision Adam keeps
2 bytes of params, 2 of grads and K = 12 of optimizer state (fp32 master, momentum,
variance) per parameter: 16*Psi replicated; ZeRO-1 4*Psi + K*Psi/Nd; ZeRO-2
2*Psi + (2+K)*Psi/Nd; ZeRO-3 (2+2+K)*Psi/Nd. Pure fp32 training keeps 4 + 4 + 8.

Activations: Korthikanti et al. 2022, §4 and Table 2, generalised term by term to
GQA, SwiGLU, RMSNorm and models without dropout; for MHA, f = 4h, GPT style and
2-byte activations it reduces exactly to sbh(34 + 5as/h) and its TP/SP/recompute rows.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from twin.spec import Job, ModelSpec
from twin.workload.params import kv_heads_per_rank, layer_params, stage_params, vocab_rows

# (params, grads, optimizer) bytes per parameter; mixed precision Adam has K = 12.
STATE_BYTES = {"bf16": (2, 2, 12), "fp16": (2, 2, 12), "fp32": (4, 4, 8)}


@dataclass(frozen=True)
class Memory:
    """Bytes held by one rank at its peak, by category."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    buffers: float = 0.0
    """Transient communication buffers: ZeRO-3/FSDP gathered units, legacy-DP gathered outputs."""

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))

    def as_dict(self) -> dict[str, float]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["total"] = self.total
        return out


def model_state_bytes(psi: float, dp: int, zero_stage: int, dtype: str = "bf16") -> Memory:
    """Params, grads and optimizer states of Psi parameters on one of Nd = dp ranks (ZeRO §5)."""
    p, g, o = (b * psi for b in STATE_BYTES[dtype])
    return Memory(params=p / dp if zero_stage >= 3 else p,
                  grads=g / dp if zero_stage >= 2 else g,
                  optimizer=o / dp if zero_stage >= 1 else o)


def activation_bytes_per_layer(model: ModelSpec, batch: int, tp: int = 1, sp: bool = False,
                               recompute: str = "none", flash_attention: bool = False) -> float:
    """Bytes one layer keeps for backward for one micro-batch on one TP rank.

    Korthikanti Table 2 (2-byte activations, 1-byte dropout masks):
      no parallelism       sbh(34 + 5as/h)
      TP                   sbh(10 + 24/t + 5as/(ht))
      TP + SP              sbh(34/t + 5as/(ht))
      TP + selective       sbh(10 + 24/t);  TP + SP + selective  34sbh/t
      full recompute       2sbh (the layer input; 2sbh/t under SP, where the input is sharded)
    The 10sbh left whole by TP are the norm inputs, the QKV and FC1 inputs and the
    dropout masks; SP splits them along the sequence. Flash attention keeps no s x s
    scores (like selective) but an fp32 log-sum-exp per query and head.
    """
    s, b, h, e = model.seq_len, batch, model.hidden_size, model.dtype_bytes
    sbh = s * b * h
    rep_div = tp if sp else 1
    if recompute == "full":
        return e * sbh / rep_div
    heads = model.num_heads // tp
    kv = kv_heads_per_rank(model, tp) * model.head_dim
    f_local = model.ffn_hidden_size // tp
    mask = 1 if model.dropout else 0
    # Whole under TP (split under SP): 2 norm inputs, QKV and FC1 inputs, 2 dropout masks.
    replicated = 4 * e * sbh + 2 * mask * sbh
    # Split by TP: Q, K, V, out-proj input, MLP intermediates.
    split = e * s * b * (heads * model.head_dim + 2 * kv + heads * model.head_dim)
    mlp_tensors = 3 if model.activation == "swiglu" else 2  # gate, up, product | act in, fc2 in
    split += mlp_tensors * e * s * b * f_local
    # Attention core: softmax output, dropout mask and dropout output (as^2 b each).
    if flash_attention or recompute == "selective":
        core = 4 * s * b * heads if flash_attention and recompute != "selective" else 0
    else:
        core = (e + (mask + e) * (1 if model.dropout else 0)) * heads * s * s * b
    return replicated / rep_div + split + core


def inflight_microbatches(job: Job, stage: int) -> float:
    """Micro-batches whose activations a pipeline rank holds at its peak, in units of
    its whole layer count.

    GPipe: all m; 1F1B: min(m, p - i) (Narayanan §2.2.1); interleaved: Megatron's
    warm-up 2(p - i - 1) + (v - 1)p plus one, in chunks of 1/v of the stage, which on
    stage 0 gives Korthikanti's p(1 + (p-1)/(p v)). Without pipelining, one.
    """
    p, m, v = job.parallel.pp, job.parallel.num_microbatches, job.parallel.pp_virtual_stages
    if p == 1:
        return 1.0
    if job.parallel.pp_schedule == "gpipe":
        return float(m)
    if job.parallel.pp_schedule == "1f1b":
        return float(min(m, p - stage))
    chunks = min(m * v, 2 * (p - stage - 1) + (v - 1) * p + 1)
    return chunks / v


def rank_memory(job: Job, rank: int) -> Memory:
    """Peak memory of one rank by category (model states, activations, buffers)."""
    model, par = job.model, job.parallel
    stage = job.grid.coord(rank, "pp")
    psi = stage_params(job, stage)
    e = model.dtype_bytes
    if par.legacy_dp:
        return _legacy_dp_memory(job, rank, psi)
    states = model_state_bytes(psi, par.dp, par.zero_stage, model.dtype)
    b, s = par.micro_batch_size, model.seq_len
    per_layer = activation_bytes_per_layer(model, b, par.tp, par.sp, par.recompute,
                                           par.flash_attention)
    n_layers = len(job.layers_on_stage(stage))
    inflight = inflight_microbatches(job, stage)
    acts = per_layer * n_layers * inflight
    sp_div = par.tp if par.sp else 1
    if stage == 0 and model.dropout:
        acts += s * b * model.hidden_size / sp_div * max(1.0, inflight)  # embedding dropout mask
    if stage == par.pp - 1:
        # final norm input, LM head input, fp32 logits (Korthikanti §4.3): one micro-batch
        # in flight on the last stage, except under GPipe (all m)
        head_inflight = par.num_microbatches if par.pp > 1 and par.pp_schedule == "gpipe" else 1
        acts += head_inflight * (2 * e * s * b * model.hidden_size / sp_div
                                 + 4 * s * b * vocab_rows(model, par.tp))
    buffers = 0.0
    if par.zero_stage == 3 and par.dp > 1:
        # FSDP units: the root (embedding, head) stays gathered from its first forward to its
        # backward, with its unsharded gradient; layer units: the current one and the
        # prefetched one (every unit when not resharded after forward) plus one unsharded grad
        unit = layer_params(model, par.tp).total
        root = psi - n_layers * unit
        gathered = 2 * unit if par.fsdp_reshard_after_forward else n_layers * unit
        buffers = (2 * root + gathered + unit) * e
    return Memory(params=states.params, grads=states.grads, optimizer=states.optimizer,
                  activations=acts, buffers=buffers)


def _legacy_dp_memory(job: Job, rank: int, psi: int) -> Memory:
    """nn.DataParallel: device 0 holds the optimizer, the reduced grads and every
    replica's gathered output (fp32 logits); the others hold a replica's params,
    grads and activations (mission seed 000: device 0 does more work)."""
    model, par = job.model, job.parallel
    p, g, o = (x * psi for x in STATE_BYTES[model.dtype])
    b, s = par.micro_batch_size, model.seq_len
    per_layer = activation_bytes_per_layer(model, b, 1, False, par.recompute,
                                           par.flash_attention)
    acts = per_layer * model.num_layers + 4 * s * b * model.vocab_size
    if rank == 0:
        gathered = 4 * s * b * model.vocab_size * par.dp
        return Memory(params=p, grads=g, optimizer=o, activations=acts, buffers=gathered)
    return Memory(params=p, grads=g, optimizer=0.0, activations=acts)
