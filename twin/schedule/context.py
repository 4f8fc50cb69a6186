"""Context parallelism's attention: one CP rank's part of a layer's attention core, forward and
backward, with the KV exchange its ``cp_method`` needs (closed forms: twin/workload/context.py).

Each rank holds s/cp tokens of every sequence, so the other passes see the model with
seq_len = s/cp (``local_model``); only the attention core, which needs every earlier token's
keys and values, is emitted here, in place of TP's single kernel (``TensorParallel.cp``):

- ring: cp steps; before step j's kernel the rank sends the KV chunk it holds to the next
  rank of the CP ring and posts the recv of step j+1's chunk from the previous one, on the
  p2p stream, so the transfer runs beside step j's compute (torch's _templated_ring_attention
  and its backward: KV round again, the fp32 dK/dV partial sums following them home);
- allgather: an all-gather of K and V, the rank's blocks over the gathered keys; backward
  gathers again and reduce-scatters dK/dV (Llama 3);
- alltoall (Ulysses): all-to-alls of q, k and v before a causal s x s kernel on heads/cp, of
  the output after; backward the mirror.

Blocks a rank computes follow ``cp_load_balance`` (twin.workload.context.ring_blocks,
allgather_blocks). An attention op's shape is (batch, heads, kv_heads, q, head_dim, causal,
kv) with kv only where it differs from q; its FLOPs 4*b*heads*q*kv*d (the full rectangle;
a causal square is timed at half, twin.cost.timed_flops).
"""

from __future__ import annotations

from twin.schedule.emit import Ctx, Idx, ProgramBuilder
from twin.spec import Job
from twin.workload.context import (
    DKV_BYTES,
    Block,
    allgather_blocks,
    buffer_bytes,
    ring_blocks,
    ulysses_kv_heads,
)
from twin.workload.params import kv_heads_per_rank


def apply_cp(out: ProgramBuilder, job: Job, rank: int) -> ContextParallel | None:
    """The CP attention of ``rank`` over its CP group (None at cp=1)."""
    if job.parallel.cp == 1:
        return None
    return ContextParallel(out, job, rank)


class ContextParallel:
    """Emits one rank's attention core under CP; ``forward`` and ``backward`` replace the
    single attention kernel of TP's layer (twin/schedule/tensor.py)."""

    def __init__(self, out: ProgramBuilder, job: Job, rank: int):
        m, par, grid = job.model, job.parallel, job.grid
        self.b = out
        self.method, self.balance, self.cp = par.cp_method, par.cp_load_balance, par.cp
        self.group = grid.group(rank, "cp")
        self.i = grid.coord(rank, "cp")
        self.next = self.group[(self.i + 1) % self.cp]
        self.prev = self.group[(self.i - 1) % self.cp]
        self.mb, self.s, self.d = par.micro_batch_size, m.seq_len, m.head_dim
        self.c = m.seq_len // par.cp
        self.heads = m.num_heads // par.tp
        self.kv_heads = kv_heads_per_rank(m, par.tp)
        self.kv_dim = self.kv_heads * self.d
        self.kv_bytes = 2 * self.mb * self.c * self.kv_dim * out.e  # a K and V chunk
        self.dkv_bytes = self.kv_bytes / out.e * DKV_BYTES
        self.full_kv = 2 * self.mb * self.s * self.kv_dim  # K and V of the whole sequence
        self.buffers = buffer_bytes(m, par)
        self.ulysses_kv = ulysses_kv_heads(m, par)
        if self.method == "ring":
            self.blocks = ring_blocks(self.cp, self.i, self.c, self.balance)
        elif self.method == "allgather":
            self.blocks = allgather_blocks(self.cp, self.i, self.c, self.balance)

    # -- the pieces ------------------------------------------------------------------
    def kernel(self, ctx: Ctx, local: str, blk: Block, deps, scale: float = 1.0,
               heads: int | None = None, kv_heads: int | None = None) -> int:
        """One attention kernel of ``blk``: Q, K, V read and O written (scaled as the kernel
        is: backward 2x, 2.5x with flash's recomputed scores)."""
        h = self.heads if heads is None else heads
        kvh = self.kv_heads if kv_heads is None else kv_heads
        e, b, d = self.b.e, self.mb, self.d
        shape = (b, h, kvh, blk.q, d, int(blk.causal)) + ((blk.kv,) if blk.kv != blk.q else ())
        return self.b.emit(ctx, local, "attention", "compute", deps, shape=shape,
                           dtype=self.b.dtype, flops=4.0 * b * h * blk.q * blk.kv * d * scale,
                           bytes=float(e * b * d * (2 * h * blk.q + 2 * kvh * blk.kv) * scale))

    def _p2p(self, ctx: Ctx, kind: str, local: str, tag: str, nbytes: float, deps,
             dtype: str | None = None) -> int:
        peer = self.next if kind == "send" else self.prev
        return self.b.emit(ctx.at(paradigm="cp"), local, kind, "p2p", deps, peer=peer,
                           tag=f"cp.{tag}.{ctx.prefix()}", bytes=float(nbytes), group_name="cp",
                           dtype=dtype or self.b.dtype)

    def _coll(self, ctx: Ctx, local: str, kind: str, nbytes: float, deps,
              dtype: str | None = None) -> Idx:
        return self.b.emit(ctx.at(paradigm="cp"), local, kind, "comm.cp", deps, group=self.group,
                           group_name="cp", bytes=float(nbytes), dtype=dtype or self.b.dtype)

    def _alloc(self, ctx: Ctx, nbytes: float) -> str:
        tag = f"cp.kv.{ctx.phase}.L{ctx.layer}.mb{ctx.mb}"
        self.b.alloc(ctx.at(paradigm="cp"), tag, "buffers", nbytes)
        return tag

    def _free(self, ctx: Ctx, tag: str, nbytes: float, after: Idx) -> None:
        self.b.free(ctx.at(paradigm="cp"), tag, "buffers", nbytes, [after])

    # -- forward ---------------------------------------------------------------------
    def forward(self, ctx: Ctx, x: Idx) -> Idx:
        """The attention core forward (or recomputed) on input ``x`` (q, k, v made)."""
        if self.method == "alltoall":
            return self._ulysses(ctx, x, backward=False)
        if self.method == "allgather":
            buf = self._alloc(ctx, self.full_kv * self.b.e)
            ag = self._coll(ctx, "cp.kv.ag", "all_gather", self.full_kv * self.b.e, [x])
            out = None
            for k, blk in enumerate(self.blocks):
                out = self.kernel(ctx, "attn" if k == 0 else f"attn.s{k}", blk, [x, ag])
            self._free(ctx, buf, self.full_kv * self.b.e, out)
            return out
        buf = self._alloc(ctx, 2 * self.kv_bytes)  # the chunk in use and the one in flight
        cur, out, last = x, None, None
        for j, blk in enumerate(self.blocks):
            nxt = None
            if j < self.cp - 1:  # pass the chunk on, post the next one's recv, then compute
                self._p2p(ctx, "send", f"cp.kv.send.s{j}", f"kv.s{j}", self.kv_bytes, [cur])
                nxt = self._p2p(ctx, "recv", f"cp.kv.recv.s{j + 1}", f"kv.s{j}", self.kv_bytes,
                                [self.b.last_compute, last])
            if blk is not None:
                a = self.kernel(ctx, "attn" if j == 0 else f"attn.s{j}", blk, [x, cur])
                # merge the partial output by its log-sum-exp (torch's _SDPAMerger, fp32)
                out = a if j == 0 else self.b.elementwise(
                    ctx, f"attn.merge.s{j}", self.mb * blk.q * self.heads * self.d, [a, out],
                    tensors=4 * DKV_BYTES / self.b.e)
                last = a
            cur = nxt
        self._free(ctx, buf, 2 * self.kv_bytes, out)
        return out

    # -- backward --------------------------------------------------------------------
    def backward(self, ctx: Ctx, deps, scale: float) -> Idx:
        """The attention core's backward from the output gradient (``deps``: it and any
        recomputed forward); returns the op after which dq, dk and dv are all made."""
        if self.method == "alltoall":
            return self._ulysses(ctx, deps, backward=True, scale=scale)
        e = self.b.e
        if self.method == "allgather":
            nbytes = self.full_kv * (e + DKV_BYTES)
            buf = self._alloc(ctx, nbytes)
            ag = self._coll(ctx, "cp.kv.ag", "all_gather", self.full_kv * e, [deps])
            last = None
            for k, blk in enumerate(self.blocks):
                last = self.kernel(ctx, "attn.bwd" if k == 0 else f"attn.bwd.s{k}", blk,
                                   [deps, ag], scale)
            rs = self._coll(ctx, "cp.dkv.rs", "reduce_scatter", self.full_kv * DKV_BYTES, [last],
                            dtype="fp32")
            self._free(ctx, buf, nbytes, rs)
            return self._cast(ctx, [last, rs])
        nbytes = 2 * (self.kv_bytes + self.dkv_bytes)
        buf = self._alloc(ctx, nbytes)
        cur, last, dkv_in = deps, None, None
        for j, blk in enumerate(self.blocks):
            nxt = nxt_dkv = None
            if j < self.cp - 1:
                self._p2p(ctx, "send", f"cp.kv.send.s{j}", f"kv.s{j}", self.kv_bytes, [cur])
                nxt = self._p2p(ctx, "recv", f"cp.kv.recv.s{j + 1}", f"kv.s{j}", self.kv_bytes,
                                [self.b.last_compute, last])
                nxt_dkv = self._p2p(ctx, "recv", f"cp.dkv.recv.s{j + 1}", f"dkv.s{j}",
                                    self.dkv_bytes, [self.b.last_compute], dtype="fp32")
            mine = None
            if blk is not None:
                last = mine = self.kernel(ctx, "attn.bwd" if j == 0 else f"attn.bwd.s{j}", blk,
                                          [deps, cur], scale)
                if dkv_in is not None:  # add this step's dK/dV to the partial sums received
                    mine = self.b.elementwise(ctx, f"attn.dkv_add.s{j}", self.kv_bytes // e,
                                              [mine, dkv_in], tensors=3 * DKV_BYTES / e)
            self._p2p(ctx, "send", f"cp.dkv.send.s{j}", f"dkv.s{j}", self.dkv_bytes,
                      [mine, dkv_in], dtype="fp32")
            cur, dkv_in = nxt, nxt_dkv
        home = self._p2p(ctx, "recv", "cp.dkv.recv.home", f"dkv.s{self.cp - 1}", self.dkv_bytes,
                         [self.b.last_compute], dtype="fp32")
        self._free(ctx, buf, nbytes, home)
        return self._cast(ctx, [last, home])

    def _cast(self, ctx: Ctx, deps) -> int:
        """dq, dk and dv from their fp32 accumulators to the model dtype (read 4, write e)."""
        n = self.mb * self.c * (self.heads * self.d + 2 * self.kv_dim)
        return self.b.elementwise(ctx, "attn.bwd.cast", n, deps, tensors=(DKV_BYTES + self.b.e) / self.b.e)

    # -- Ulysses ---------------------------------------------------------------------
    def _ulysses(self, ctx: Ctx, x, backward: bool, scale: float = 1.0) -> Idx:
        """All-to-alls over the CP group around one causal s x s kernel on heads/cp heads:
        forward q, k, v in and the output out; backward the output gradient in and dq, dk, dv
        out. The KV all-to-all carries the rank's KV heads replicated up to cp when fewer."""
        e, b, c, d = self.b.e, self.mb, self.c, self.d
        q, kv = b * c * self.heads * d * e, b * c * self.ulysses_kv * d * e
        blk = Block(self.s, self.s, True)
        heads, kv_heads = self.heads // self.cp, self.ulysses_kv // self.cp
        if not backward:
            ins = [self._coll(ctx, f"cp.{t}.a2a", "all_to_all", n, [x])
                   for t, n in (("q", q), ("k", kv), ("v", kv))]
            a = self.kernel(ctx, "attn", blk, [x, ins], heads=heads, kv_heads=kv_heads)
            return self._coll(ctx, "cp.out.a2a", "all_to_all", q, [a])
        g = self._coll(ctx, "cp.dout.a2a", "all_to_all", q, [x])
        a = self.kernel(ctx, "attn.bwd", blk, [x, g], scale, heads=heads, kv_heads=kv_heads)
        outs = [self._coll(ctx, f"cp.d{t}.a2a", "all_to_all", n, [a])
                for t, n in (("q", q), ("k", kv), ("v", kv))]
        return outs[-1]  # one FIFO stream: dv done means dq and dk are
