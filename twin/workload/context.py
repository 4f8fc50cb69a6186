"""Context parallelism in closed form: each CP rank's attention blocks, its CP traffic per layer
and the KV buffers it holds.

A sequence of s tokens is split over cp ranks, c = s/cp tokens each; every token-proportional
op (norms, GEMMs, MLP, embedding, head, loss, TP/SP and PP messages) works on b*c tokens. Only
attention needs the other ranks' keys and values (kv_dim = KV heads per TP rank x head_dim):

- ring (Liu et al. 2023, Ring Attention; torch's _templated_ring_attention): cp steps; at step
  j rank i attends its queries to the KV chunk of rank i-j, received from rank i-1 while step
  j-1 computes. Forward: cp-1 sends of 2*b*c*kv_dim*e per layer. Backward: the KV chunks go
  round again (cp-1 sends) and the dK/dV partial sums follow them home (cp sends of
  2*b*c*kv_dim*4: torch accumulates them in fp32, ``_cp_options.convert_to_f32``);
- allgather (Llama 3, Dubey et al. 2024, §3.3.2): one all-gather of K and V (2*b*s*kv_dim*e,
  the gathered output), local attention of c queries over all keys; backward all-gathers K
  and V again (as torch's backward does) and reduce-scatters dK/dV (2*b*s*kv_dim*4, in fp32);
- alltoall (DeepSpeed-Ulysses, Jacobs et al. 2023): four all-to-alls forward (q, k, v: the
  sequence gathered, the heads scattered; the output back), their mirror backward (dout;
  dq, dk, dv), each the send buffer b*c*width*e; heads/cp heads over the whole sequence.

Causal work per rank (ring and allgather), in units of a c x c block: headtail (rank i holds
chunks i and 2cp-1-i of s/(2cp)) gives every rank cp/2 blocks; none (rank i holds chunk i)
gives rank i i + 1/2 blocks, a share (2i+1)/cp^2 of the causal total cp^2/2.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from twin.spec import ModelSpec, ParallelPlan
from twin.workload.params import kv_heads_per_rank

DKV_BYTES = 4
"""Bytes per element of the dK/dV partial sums CP communicates: fp32 (torch's
_ContextParallelOptions.convert_to_f32 accumulates the KV gradients in float32)."""


class Block(NamedTuple):
    """One attention kernel call of a CP rank: queries x keys, causal (the diagonal) or full."""

    q: int
    """Query tokens."""
    kv: int
    """Key/value tokens."""
    causal: bool
    """A causal square (the kernel skips its masked half) or a full rectangle."""

    @property
    def work(self) -> float:
        """Score entries computed: q*kv, half a square when causal."""
        return self.q * self.kv / (2 if self.causal else 1)


def local_model(model: ModelSpec, par: ParallelPlan) -> ModelSpec:
    """The model as one CP rank's token-proportional ops see it: seq_len = s/cp (itself at cp=1)."""
    return model if par.cp == 1 else replace(model, seq_len=model.seq_len // par.cp)


def dp_dims(par: ParallelPlan) -> str:
    """The grid axes gradients are reduced and model states sharded over: dp, or dp x cp
    (CP ranks see different tokens of the same weights; torchtitan's dp_shard_cp)."""
    return "dp-cp" if par.cp > 1 else "dp"


def programs_differ(par: ParallelPlan) -> bool:
    """Whether the CP ranks of one pipeline stage run different programs: the ring's blocks
    depend on the rank (under headtail their shapes, under none their number), and so does
    allgather's work without load balancing; Ulysses and balanced allgather are uniform."""
    if par.cp == 1 or par.cp_method == "alltoall":
        return False
    return par.cp_method == "ring" or par.cp_load_balance == "none"


def ring_blocks(cp: int, i: int, c: int, balance: str) -> list[Block | None]:
    """Rank i's block at each of the ring's cp steps (None: skipped, all masked), torch's
    _is_causal_behavior and its round-robin branches: step 0 the local causal square; then
    under headtail all queries against the first half of the KV chunk of an earlier rank (j <=
    i), else the second half of the queries against the whole chunk; under none the full
    block of an earlier rank's chunk, nothing for a later one."""
    out: list[Block | None] = [Block(c, c, True)]
    for j in range(1, cp):
        if balance == "headtail":
            out.append(Block(c, c // 2, False) if j <= i else Block(c // 2, c, False))
        else:
            out.append(Block(c, c, False) if j <= i else None)
    return out


def allgather_blocks(cp: int, i: int, c: int, balance: str) -> list[Block]:
    """Rank i's attention over the gathered keys: the local causal square (under headtail its
    two chunks concatenated: head and tail diagonals and tail x head), then the rest of its
    prefix as one full rectangle (none: i chunks; headtail: (cp-1) half chunks per query)."""
    rest = i * c if balance == "none" else (cp - 1) * (c // 2)
    return [Block(c, c, True)] + ([Block(c, rest, False)] if rest else [])


def rank_blocks(par: ParallelPlan, seq_len: int, i: int) -> list[Block]:
    """The attention blocks CP rank i computes (ring and allgather; Ulysses: one causal s x s
    square over heads/cp)."""
    c = seq_len // par.cp
    if par.cp_method == "ring":
        return [b for b in ring_blocks(par.cp, i, c, par.cp_load_balance) if b is not None]
    if par.cp_method == "allgather":
        return allgather_blocks(par.cp, i, c, par.cp_load_balance)
    return [Block(seq_len, seq_len, True)]


def attention_share(par: ParallelPlan, seq_len: int, i: int) -> float:
    """Rank i's share of one sequence's causal attention work (s^2/2 score entries; Ulysses
    does the whole causal square on 1/cp of the heads)."""
    work = sum(b.work for b in rank_blocks(par, seq_len, i))
    return work / (seq_len * seq_len / 2) / (par.cp if par.cp_method == "alltoall" else 1)


def ulysses_kv_heads(model: ModelSpec, par: ParallelPlan) -> int:
    """KV heads a rank sends through Ulysses' all-to-all: its TP share, replicated up to cp
    when fewer (each CP rank then receives one, as TP replicates KV heads)."""
    return max(kv_heads_per_rank(model, par.tp), par.cp)


Calls = list[tuple[str, int, float]]
"""CP calls: (op kind, count, bytes each)."""


def layer_traffic(model: ModelSpec, par: ParallelPlan) -> tuple[Calls, Calls]:
    """(forward, backward) CP calls of one layer, one micro-batch, one rank: the closed forms
    of the module docstring (sizes as nccl-tests count them: all-gather the gathered output,
    reduce-scatter the full input, all-to-all the send buffer)."""
    b, cp, e, d = par.micro_batch_size, par.cp, model.dtype_bytes, model.head_dim
    c = model.seq_len // cp
    kv_dim = kv_heads_per_rank(model, par.tp) * d
    if par.cp_method == "ring":
        chunk = 2 * b * c * kv_dim
        return [("send", cp - 1, chunk * e)], [("send", cp - 1, chunk * e),
                                                ("send", cp, chunk * DKV_BYTES)]
    if par.cp_method == "allgather":
        full = 2 * b * model.seq_len * kv_dim
        return [("all_gather", 1, full * e)], [("all_gather", 1, full * e),
                                               ("reduce_scatter", 1, full * DKV_BYTES)]
    q = b * c * (model.num_heads // par.tp) * d * e
    kv = b * c * ulysses_kv_heads(model, par) * d * e
    calls = [("all_to_all", 2, q), ("all_to_all", 2, kv)]  # q, out; k, v (backward: the grads)
    return calls, calls


def step_calls(model: ModelSpec, par: ParallelPlan, layers: int) -> Calls:
    """One rank's CP calls over a step: every layer of its stage, every micro-batch, the
    attention forward once more under selective or full recomputation."""
    if par.cp == 1:
        return []
    fwd, bwd = layer_traffic(model, par)
    runs = layers * par.num_microbatches
    again = 2 if par.recompute in ("selective", "full") else 1
    return [(k, n * runs * again, nbytes) for k, n, nbytes in fwd] + \
        [(k, n * runs, nbytes) for k, n, nbytes in bwd]


def buffer_bytes(model: ModelSpec, par: ParallelPlan) -> float:
    """The KV buffers a CP rank holds at its peak, a layer's backward: ring, the KV chunk being
    used and the one in flight plus two dK/dV chunks (fp32); allgather, the gathered K and V
    and the unreduced dK/dV of the whole sequence (fp32); alltoall none beyond its activations
    (the exchanged q, k, v are the same bytes as the local ones)."""
    if par.cp == 1 or par.cp_method == "alltoall":
        return 0.0
    b, e = par.micro_batch_size, model.dtype_bytes
    kv_dim = kv_heads_per_rank(model, par.tp) * model.head_dim
    tokens = model.seq_len // par.cp if par.cp_method == "ring" else model.seq_len
    copies = 2 if par.cp_method == "ring" else 1
    return copies * 2 * b * tokens * kv_dim * (e + DKV_BYTES)
