"""Ring attention in plain PyTorch over a CP process group (gloo or NCCL): the counterpart of
the schedule's ``cp_method=ring`` (twin/schedule/context.py).

Why not torch's own ``context_parallel``: in torch 2.13 it dispatches only the CUDA SDPA
kernels (flash, memory-efficient, cuDNN); on CPU, ``F.scaled_dot_product_attention`` runs
``aten._scaled_dot_product_flash_attention_for_cpu``, which has no CP sharding rule
("does not have a sharding strategy registered"), so it cannot run on gloo ranks. This
module follows the same algorithm (torch's ``_templated_ring_attention`` and its backward):

- the sequence in 2cp chunks, rank i holding chunks i and 2cp-1-i (``headtail``), or in cp
  contiguous chunks (``none``);
- forward, cp steps: at step j the KV chunk of rank i-j, received from rank i-1 while the
  previous step computed, is sent on to rank i+1 (K and V flattened into one message); step
  0 attends causally over the local chunk, later steps to the unmasked part only (headtail:
  all queries against the first half of an earlier rank's chunk, or the second half of the
  queries against a later rank's; none: an earlier rank's whole chunk, nothing of a later
  one); the partial outputs are merged by their log-sum-exp, in fp32;
- backward: the KV chunks go round again, and the dK/dV partial sums (fp32) follow them:
  each rank adds its share and sends them on, cp sends, the last one bringing each rank
  its own chunk's gradients.

Scores are computed explicitly (q k^T), so the kernels are plain matmuls: the point is the
communication, which ``executor.conformance.capture`` records at the c10d dispatcher.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

KV_TAG, DKV_TAG = 17, 29


def shard(x: torch.Tensor, cp: int, i: int, balance: str, dim: int = 2) -> torch.Tensor:
    """Rank i's part of a sequence dimension: chunks i and 2cp-1-i of 2cp (headtail), else
    chunk i of cp."""
    if balance == "headtail":
        chunks = x.chunk(2 * cp, dim=dim)
        return torch.cat([chunks[i], chunks[2 * cp - 1 - i]], dim=dim)
    return x.chunk(cp, dim=dim)[i]


def _future(s: torch.Tensor) -> torch.Tensor:
    """The causal mask of a square block of scores: key j after query i."""
    n = s.shape[-1]
    return torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1)


def _block(q, k, v, causal: bool, scale: float):
    """Attention of q over k, v (heads already matched): output and fp32 log-sum-exp."""
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(_future(s), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return (torch.softmax(s, dim=-1) @ v.float()), lse


def _plan(cp: int, i: int, j: int, balance: str) -> str | None:
    """Which part of step j's block rank i computes: all (causal at step 0), kv-half (all
    queries, first half of the KV chunk), q-half (second half of the queries, whole chunk)
    or None (masked)."""
    if j == 0:
        return "all"
    if balance == "headtail":
        return "kv-half" if j <= i else "q-half"
    return "all" if j <= i else None


class _Ring:
    """One rank's ring: sends to the next CP rank, receives from the previous one."""

    def __init__(self, group):
        self.group = group
        self.cp, self.i = dist.get_world_size(group), dist.get_rank(group)
        ranks = dist.get_process_group_ranks(group)
        self.next, self.prev = ranks[(self.i + 1) % self.cp], ranks[(self.i - 1) % self.cp]

    def exchange(self, send: torch.Tensor, tag: int):
        """Post the send of ``send`` to the next rank and the recv of the same size from the
        previous; returns (the buffer, a wait function)."""
        buf, send = torch.empty_like(send), send.contiguous()
        works = [dist.isend(send, self.next, group=self.group, tag=tag),
                 dist.irecv(buf, self.prev, group=self.group, tag=tag)]
        return buf, lambda: (send, [w.wait() for w in works])  # (the buffer kept until done)


def _repeat(kv: torch.Tensor, heads: int) -> torch.Tensor:
    return kv.repeat_interleave(heads // kv.shape[1], dim=1)


class RingAttention(torch.autograd.Function):
    """Causal attention of the rank's queries over the whole sequence's keys and values,
    which travel round the CP ring; q (b, h, c, d), k and v (b, kv_heads, c, d)."""

    @staticmethod
    def forward(ctx, q, k, v, group, balance):
        ring = _Ring(group)
        cp, i, heads = ring.cp, ring.i, q.shape[1]
        scale = q.shape[-1] ** -0.5
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), device=q.device)
        kv = torch.cat([k.flatten(), v.flatten()])
        half = q.shape[2] // 2
        for j in range(cp):
            wait = None
            if j < cp - 1:
                nxt, wait = ring.exchange(kv, KV_TAG)
            part = _plan(cp, i, j, balance)
            if part is not None:
                kj, vj = kv[:k.numel()].view(k.shape), kv[k.numel():].view(v.shape)
                rows = slice(half, None) if part == "q-half" else slice(None)
                if part == "kv-half":
                    kj, vj = kj[:, :, :half], vj[:, :, :half]
                o, s = _block(q[:, :, rows], _repeat(kj, heads), _repeat(vj, heads), j == 0,
                              scale)
                new = torch.logaddexp(lse[:, :, rows], s)
                out[:, :, rows] = out[:, :, rows] * torch.exp(lse[:, :, rows] - new)[..., None] \
                    + o * torch.exp(s - new)[..., None]
                lse[:, :, rows] = new
            if wait is not None:
                wait()
                kv = nxt
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.balance = group, balance
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.group)
        cp, i, heads = ring.cp, ring.i, q.shape[1]
        scale = q.shape[-1] ** -0.5
        dout = dout.float()
        delta = (dout * out).sum(-1)  # rowsum(dO * O), FlashAttention-2's D
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.cat([k.flatten(), v.flatten()])
        half, group_size = q.shape[2] // 2, heads // k.shape[1]
        dkv_in, dkv_wait = None, None  # the partial sums arriving for the chunk held next
        for j in range(cp):
            wait = None
            if j < cp - 1:
                nxt, wait = ring.exchange(kv, KV_TAG)
            mine = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            part = _plan(cp, i, j, ctx.balance)
            if part is not None:
                kj, vj = kv[:k.numel()].view(k.shape), kv[k.numel():].view(v.shape)
                rows = slice(half, None) if part == "q-half" else slice(None)
                cols = slice(None, half) if part == "kv-half" else slice(None)
                kr, vr = _repeat(kj[:, :, cols], heads).float(), _repeat(vj[:, :, cols], heads).float()
                qr, dor = q[:, :, rows].float(), dout[:, :, rows]
                s = (qr @ kr.transpose(-1, -2)) * scale
                if j == 0:
                    s = s.masked_fill(_future(s), float("-inf"))
                p = torch.exp(s - lse[:, :, rows][..., None])
                dv = p.transpose(-1, -2) @ dor
                ds = p * (dor @ vr.transpose(-1, -2) - delta[:, :, rows][..., None])
                dq[:, :, rows] += ds @ kr * scale
                dk = ds.transpose(-1, -2) @ qr * scale
                b, _, c, d = k.shape  # sum the query heads of each KV head (GQA)
                dk = dk.view(b, -1, group_size, dk.shape[2], d).sum(2)
                dv = dv.view(b, -1, group_size, dv.shape[2], d).sum(2)
                full_k = torch.zeros(k.shape, device=k.device)
                full_v = torch.zeros(v.shape, device=v.device)
                full_k[:, :, cols], full_v[:, :, cols] = dk, dv
                mine = torch.cat([full_k.flatten(), full_v.flatten()])
            if dkv_wait is not None:
                dkv_wait()
                dkv = dkv_in + mine
            else:
                dkv = mine
            dkv_in, dkv_wait = ring.exchange(dkv, DKV_TAG)  # the partial sums move on
            if wait is not None:
                wait()
                kv = nxt
        dkv_wait()
        dk, dv = dkv_in[:k.numel()].view(k.shape), dkv_in[k.numel():].view(v.shape)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def ring_attention(q, k, v, group, balance: str = "headtail") -> torch.Tensor:
    """Causal ring attention of this rank's shard (see the module docstring)."""
    return RingAttention.apply(q, k, v, group, balance)
