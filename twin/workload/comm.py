"""Communication volume per step of one rank, per group, in closed form.

Sizes follow nccl-tests (PERFORMANCE.md): all-reduce and broadcast count the buffer,
all-gather the gathered output, reduce-scatter the full input. ``wire_bytes`` is
what the rank itself sends with ring algorithms: 2(n-1)/n * S for all-reduce,
(n-1)/n * S for all-gather and reduce-scatter, S for broadcast, reduce and send.

- DP (DDP): one all-reduce of the gradients per step (no_sync across micro-batches).
- ZeRO-1: reduce-scatter of gradients + all-gather of parameters, 2*Psi like DDP;
  ZeRO-2 reduce-scatters every micro-batch (``grad_sync`` changes either default);
  ZeRO-3 all-gathers parameters for
  forward and again for backward (unless not resharded) and reduce-scatters
  gradients, per micro-batch: 3*Psi, 1.5x DDP (ZeRO §7). FSDP's root unit
  (embedding, head) is gathered once per micro-batch. (Under PP with several
  micro-batches in flight, units not resharded after forward can stay gathered from
  one micro-batch's forward to the next: the schedule then gathers less.)
- HSDP: ZeRO-3's traffic over the dp_shard group, plus an all-reduce of each reduce-scattered
  shard (Psi / dp_shard) over the dp_replicate group.
- TP: per layer and micro-batch two all-reduces of b*s*h forward and two backward
  (Narayanan §3.2); with SP the same bytes as all-gathers and reduce-scatters
  (Korthikanti §4.2.2); full recompute repeats the forward two (stopping early, the
  all-gathers and the first all-reduce or reduce-scatter); op-level SAC re-runs the
  two all-gathers (SP: the reduce-scatters' outputs are kept) or the first all-reduce.
  Async TP sends each of a layer's all-gathers and reduce-scatters as tp - 1 ring steps of
  b*s*h/t (the same wire bytes).
- CP: every token-proportional message above on s/cp tokens, gradients over dp x cp, and
  the attention's KV exchange per layer (twin/workload/context.py).
- PP: b*s*h forward to the next stage and backward to the previous per
  micro-batch and chunk (b*s*h/t under SP); interleaving multiplies by v.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from twin.spec import Job
from twin.vocab import wire_factor
from twin.workload.context import dp_dims, step_calls
from twin.workload.params import (
    fp8_tp_gather,
    fp8_weight_numel,
    fsdp_layer_units,
    norm_params,
    stage_params,
    vocab_rows,
)


@dataclass
class GroupTraffic:
    """What one rank moves in one group over one step."""

    name: str
    size: int
    calls: dict[str, list[float]] = field(default_factory=dict)
    """kind -> [count, bytes]"""

    def add(self, kind: str, count: float, nbytes: float) -> None:
        c = self.calls.setdefault(kind, [0, 0.0])
        c[0] += count
        c[1] += count * nbytes

    @property
    def bytes(self) -> float:
        return sum(b for _, b in self.calls.values())

    @property
    def wire_bytes(self) -> float:
        return sum(wire_factor(k, self.size) * b for k, (_, b) in self.calls.items())

    def as_dict(self) -> dict:
        return {"size": self.size, "bytes": self.bytes, "wire_bytes": self.wire_bytes,
                "collectives": [{"kind": k, "count": c, "bytes": b}
                                for k, (c, b) in self.calls.items()]}


def step_traffic(job: Job, rank: int) -> dict[str, GroupTraffic]:
    """Per-step traffic of ``rank`` in its dp, tp, pp (and tied-embedding) groups; idle groups omitted."""
    model, par, grid = job.model, job.parallel, job.grid
    stage = grid.coord(rank, "pp")
    m, e = par.num_microbatches, model.dtype_bytes
    psi_bytes = stage_params(job, stage) * e
    out: dict[str, GroupTraffic] = {}

    hsdp = par.dp_replicate > 1
    if par.dp * par.cp > 1:  # gradients over dp x cp under CP (twin.workload.context.dp_dims)
        dp = GroupTraffic("dp_shard", par.shard_degree) if hsdp else \
            GroupTraffic(dp_dims(par), par.dp * par.cp)
        syncs = m if par.sync_every_microbatch else 1
        if par.legacy_dp:
            tokens = par.micro_batch_size * model.seq_len
            logits = 4 * tokens * model.vocab_size * par.dp
            dp.add("scatter", m, 8 * tokens * par.dp)  # input tokens
            dp.add("broadcast", m, psi_bytes)  # replicate() every forward
            dp.add("gather", m, logits)  # outputs to device 0
            dp.add("scatter", m, logits)  # output gradients back
            dp.add("reduce", m, psi_bytes)  # gradients to device 0
        elif par.zero_stage == 0:
            dp.add("all_reduce", syncs, psi_bytes)
        elif par.zero_stage in (1, 2):
            dp.add("reduce_scatter", syncs, psi_bytes)
            dp.add("all_gather", 1, psi_bytes)
        else:
            # layer units gathered for forward and again for backward; the root unit
            # (embedding, head) stays gathered from forward to backward
            root_bytes = (stage_params(job, stage) - sum(fsdp_layer_units(job, stage))) * e
            gathers = 2 if par.fsdp_reshard_after_forward else 1
            fp8_saved = fp8_weight_numel(job, stage) * (e - 1) if par.float8_fsdp_all_gather else 0
            dp.add("all_gather", m, gathers * (psi_bytes - root_bytes - fp8_saved) + root_bytes)
            # gradients at the reduce dtype (parallel.fsdp_reduce_dtype)
            dp.add("reduce_scatter", syncs, stage_params(job, stage) * job.fsdp_reduce_bytes)
        out[dp.name] = dp
        if hsdp:  # (HSDP is FSDP: the shard all-reduced at the reduce dtype)
            rep = out["dp_replicate"] = GroupTraffic("dp_replicate", par.dp_replicate)
            rep.add("all_reduce", syncs,
                    stage_params(job, stage) * job.fsdp_reduce_bytes / par.shard_degree)

    tokens = par.micro_batch_size * model.seq_len // par.cp  # the tokens one rank holds
    bsh = tokens * model.hidden_size * e
    if par.tp > 1:
        tp = GroupTraffic("tp", par.tp)
        layers = len(job.layers_on_stage(stage))
        # per layer: 2 forward and 2 backward; a full recomputation the forward's 2 again,
        # but its last when it stops early (recompute_early_stop: fc2 is not re-run)
        full = par.recompute == "full"
        redo = 0 if not full else 1 if par.recompute_early_stop else 2
        gathers, reductions = 4 + (2 if full else 0), 4 + redo
        # the forward gathers (and their re-runs) at a byte per element under Float8 TP
        fp8 = fp8_tp_gather(par)
        fwd = 2 + (2 if full else 0) if fp8 else 0
        if par.async_tp:  # each all-gather and reduce-scatter as tp - 1 ring steps (asynctp.py)
            tp.add("send", layers * m * (gathers - fwd + reductions) * (par.tp - 1), bsh / par.tp)
            if fwd:
                tp.add("send", layers * m * fwd * (par.tp - 1), bsh / par.tp / e)
        elif par.sp:  # each all-reduce becomes a reduce-scatter and an all-gather
            tp.add("all_gather", layers * m * (gathers - fwd), bsh)
            if fwd:
                tp.add("all_gather", layers * m * fwd, bsh / e)
            tp.add("reduce_scatter", layers * m * reductions, bsh)
        else:
            tp.add("all_reduce", layers * m * reductions, bsh)
        if par.recompute == "op":  # op-level SAC re-runs the gathers (SP) or out_proj's reduce
            if par.sp:
                tp.add("all_gather", layers * m * 2, bsh / e if fp8 else bsh)
            else:
                tp.add("all_reduce", layers * m, bsh)
        if stage == 0:  # vocab-parallel embedding: partial sums combined forward
            if par.sp:  # reduce-scattered into the sequence shards, gathered back in backward
                tp.add("reduce_scatter", m, bsh)
                tp.add("all_gather", m, bsh)
            else:
                tp.add("all_reduce", m, bsh)
        if stage == job.head_stage:  # LM head input: gathered (SP) forward, reduced backward
            if par.sp:
                tp.add("all_gather", m, bsh)
                tp.add("reduce_scatter", m, bsh)
            else:
                tp.add("all_reduce", m, bsh)
            # vocab-parallel cross-entropy: max, sum of exp, target logit (fp32 per token)
            tp.add("all_reduce", 3 * m, 4 * tokens)
        if par.sp and par.sp_norm_grad_sync != "none":
            # the norm weights' partial gradients (each rank saw s/t of the sequence)
            norms = len(job.layers_on_stage(stage)) * 2 * norm_params(model) + \
                (norm_params(model) if stage == job.head_stage else 0)
            calls = 1 if par.sp_norm_grad_sync == "coalesced" else \
                norms // model.hidden_size
            tp.add("all_reduce", calls, norms * e / calls)
        out["tp"] = tp

    if par.pp > 1:
        pp = GroupTraffic("pp", par.pp)
        msg = bsh / (par.tp if par.sp else 1)
        where = job.placement  # a chunk sends to its neighbours on other ranks (not a V's turn)
        sends = sum((c + 1 < len(where) and where[c + 1] != stage) + (c > 0 and where[c - 1] != stage)
                    for c, s in enumerate(where) if s == stage)
        pp.add("send", m * sends, msg)
        out["pp"] = pp
        ends = (where[0], job.head_stage)
        if model.tie_embeddings and ends[0] != ends[1] and stage in ends:
            # Megatron keeps the tied embedding on the first and last stage and
            # all-reduces its gradient between the two once per step.
            embd = GroupTraffic("embd", 2)
            shard = par.shard_degree if par.zero_stage >= 2 else 1  # gradients sharded over dp
            embd.add("all_reduce", 1, vocab_rows(model, par.tp) * model.hidden_size * e / shard)
            out["embd"] = embd
    if par.cp > 1:  # the attention's KV exchange (twin.workload.context)
        cp = out["cp"] = GroupTraffic("cp", par.cp)
        for kind, count, nbytes in step_calls(model, par, len(job.layers_on_stage(stage))):
            cp.add(kind, count, nbytes)
    return out
