"""Tensor (Megatron) and sequence parallelism: the ops of one layer, the embedding and the head.

Megatron's layer (Shoeybi et al. 2019, §3; Korthikanti et al. 2022, §4.2.2): QKV and
FC1 are column-parallel (Y = XA, A split along its columns as [A_1 ... A_t]), the
out-projection and FC2 row-parallel (A split along its rows, partial sums added by an
all-reduce). Operator f (before a column-parallel GEMM) is the identity forward and an
all-reduce backward; operator g (after a row-parallel GEMM) an all-reduce forward and the
identity backward: 2 all-reduces of b*s*h forward and 2 backward per layer. Under SP, g
becomes a reduce-scatter (backward: all-gather) and f an all-gather (backward:
reduce-scatter), and norms, dropout and residuals work on s/t of the sequence. GQA with
fewer KV heads than TP ranks replicates KV heads (one per rank).

Each function takes the index of the op producing its input and returns the index of the
op producing its output; backward functions also report the ops after which each
parameter's gradient is ready (for DDP buckets and ZeRO).
"""

from __future__ import annotations

from functools import partial

from twin.schedule import stamp
from twin.schedule.asynctp import AsyncTP, GemmSpec
from twin.schedule.emit import Ctx, Idx, ProgramBuilder
from twin.schedule.passes import EMBED, LAYER, Pass, Unit
from twin.schedule.stage import HEAD, Key
from twin.spec import ModelSpec, ParallelPlan
from twin.workload.params import fp8_tp_gather, kv_heads_per_rank, vocab_rows


def apply_tp(out: ProgramBuilder, model: ModelSpec, par: ParallelPlan, group: tuple[int, ...],
             tensors: list[tuple[Key, int]]) -> TensorParallel:
    """The innermost pass: every unit's body, with its TP/SP collectives (plain compute at tp=1)."""
    return TensorParallel(out, model, par, group, tensors)


class TensorParallel(Pass):
    """Emits one rank's layer, embedding and head ops for its TP group ``group``.

    As a pass it runs each unit's body (``run``) and, at step end under SP, the norm
    weights' gradient all-reduce (``finalize_grads``) over ``tensors`` (the stage's
    (key, numel) in registration order)."""

    def __init__(self, out: ProgramBuilder, model: ModelSpec, par: ParallelPlan,
                 group: tuple[int, ...], tensors: list[tuple[Key, int]] = ()):
        self.b = out
        self.model, self.par = model, par
        self.tp, self.sp = par.tp, par.sp
        self.group = group
        self.tensors = tensors
        m = model
        self.mb = par.micro_batch_size
        self.tokens = self.mb * m.seq_len
        self.local_tokens = self.tokens // self.tp if self.sp else self.tokens
        self.h, self.d = m.hidden_size, m.head_dim
        self.heads = m.num_heads // self.tp
        self.kv_heads = kv_heads_per_rank(m, self.tp)
        self.q = self.heads * self.d
        self.kv = self.kv_heads * self.d
        self.f = m.ffn_hidden_size // self.tp
        self.vocab = vocab_rows(m, self.tp)
        self.act_bytes = out.e * self.tokens * self.h  # b*s*h, the TP message
        self.eager = not par.flash_attention
        self.rope = m.position_embedding == "rope"
        self.paradigm = out.gemm_paradigm = "sp" if self.sp else ("tp" if self.tp > 1 else "")
        self.moe = None  # a MoE model's expert layers (twin/schedule/moe.py), set by the step
        self.cp = None  # context parallelism's attention core (twin/schedule/context.py), same
        self.fp8_gather = fp8_tp_gather(par)
        """SP's forward all-gathers move the shard cast to FP8; the GEMMs after them cast
        their weights only (twin.workload.params.fp8_tp_gather)."""
        self.async_tp = AsyncTP(out, group, self.tokens, self.h, self.fp8_gather) \
            if par.async_tp and self.tp > 1 else None
        """Async TP: the SP collectives and their GEMMs as chunked, overlapped steps."""
        self.deferred: list | None = None
        """Split backward (I then W): the weight-gradient ops held back for the W action, as
        (grads, name, emit); None: emitted in place."""
        self.stamper = stamp.Stamper(out)
        """Dense layer bodies recorded once and stamped after (twin/schedule/stamp.py)."""
        self.ce: dict[int, Idx] = {}
        """Micro-batch -> its cross-entropy's last all-reduce, which the loss's backward reads."""

    def _stamps(self, ctx: Ctx | None) -> bool:
        """Whether the layer's body (None: every body of a dense model) may be stamped: a
        dense layer without CP or a split backward (its ops depend on the mb by labels alone)."""
        return stamp.ENABLED and self.cp is None and self.deferred is None \
            and (self.moe is None or ctx is not None and not self.moe.is_moe(ctx.layer))

    # -- as a pass -------------------------------------------------------------------
    def action_key(self, mb: int) -> tuple | None:
        return () if self._stamps(None) else None

    def run(self, unit: Unit) -> Idx:
        """The unit's body; its input is ``unit.x`` and ``unit.deps``."""
        ctx, deps = unit.ctx, [unit.x, unit.deps]
        if not unit.backward:
            if unit.kind == EMBED:
                return self.embedding_forward(ctx, deps)
            if unit.kind == LAYER:
                return self.layer_forward(ctx, deps)
            return self.head_forward(ctx, deps)
        if unit.kind == EMBED:
            return self.embedding_backward(ctx, deps, unit.grads)
        if unit.kind == LAYER:
            return self.layer_backward(ctx, deps, unit.grads,
                                       recompute_attention=unit.recompute_attention,
                                       recompute=unit.recompute)
        return self.head_backward(ctx, deps, unit.grads)

    def finalize_grads(self, ctx: Ctx, waits: list[Idx]) -> list[Idx]:
        """SP: all-reduce the replicated norm tensors' gradients over TP, when
        ``sp_norm_grad_sync`` asks.

        Under SP a norm sees s/t of the sequence, so its weight gradient is a partial sum
        (Korthikanti et al. 2022, §4.2.2). per_tensor: one call per tensor (PyTorch's
        DTensor SequenceParallel); coalesced: one call for all (Megatron's
        finalize_model_grads), the same bytes."""
        if not self.sp or self.par.sp_norm_grad_sync == "none":
            return []
        ctx = ctx.at(paradigm="sp")
        norms = [(key, n) for key, n in self.tensors
                 if key[1].startswith(("norm1.", "norm2.", "final_norm.", "router."))]
        if self.par.sp_norm_grad_sync == "coalesced":
            return [self.b.collective(ctx, "sp.norm_grads.ar", "all_reduce", self.group, "tp",
                                      sum(n for _, n in norms) * self.b.e, waits, stream="comm.tp")]
        return [self.b.collective(ctx, f"sp.{'head' if layer == HEAD else f'L{layer}'}.{name}.ar",
                                  "all_reduce", self.group, "tp", n * self.b.e, waits,
                                  stream="comm.tp")
                for (layer, name), n in norms]

    def _weight(self, grads: dict[str, int], local: str, emit: partial) -> None:
        """A weight-gradient op (wgrad GEMM, the embedding's scatter): emitted now into
        ``grads[local]``, or held back for the W action under a split backward."""
        if self.deferred is None:
            grads[local] = emit()
        else:
            self.deferred.append((grads, local, emit))

    # -- the two TP operators ------------------------------------------------------
    def _g(self, ctx: Ctx, local: str, x: Idx) -> Idx:
        """After a row-parallel GEMM: all-reduce (TP) or reduce-scatter (SP)."""
        kind = "reduce_scatter" if self.sp else "all_reduce"
        y = self.b.collective(ctx.at(paradigm=self.paradigm), local, kind, self.group, "tp",
                              self.act_bytes, [x], stream="comm.tp")
        return x if y is None else y

    def _f(self, ctx: Ctx, local: str, x: Idx, fp8: bool = False) -> Idx:
        """Before a column-parallel GEMM: all-gather under SP (identity under plain TP);
        ``fp8``: of the shard cast to FP8 first, a byte per element (``fp8_gather``)."""
        if not self.sp:
            return x
        if fp8:
            x = self.b.fp8_cast(ctx, local, self.local_tokens * self.h, 0, [x])
        return self.b.collective(ctx.at(paradigm=self.paradigm), local, "all_gather",
                                 self.group, "tp", self.act_bytes / self.b.e if fp8 else
                                 self.act_bytes, [x], stream="comm.tp",
                                 dtype=self.b.linear_dtype if fp8 else None)

    def _f_bwd(self, ctx: Ctx, local: str, x: Idx) -> Idx:
        """Backward of f: all-reduce (TP) or reduce-scatter (SP) of the input gradient, as g."""
        return self._g(ctx, local, x)

    def _g_bwd(self, ctx: Ctx, local: str, x: Idx) -> Idx:
        """Backward of g: all-gather under SP (identity under plain TP)."""
        return self._f(ctx, local, x)

    def _ag_gemms(self, ctx: Ctx, local: str, x: Idx,
                  specs: list[GemmSpec]) -> tuple[Idx, list[Idx]]:
        """An all-gather (SP; none under plain TP) feeding column-parallel GEMMs, or their
        chunked fusion under async TP: (the gathered input, each GEMM's output). In
        backward the gather is g's (an all-reduce under plain TP, after the GEMMs' input)."""
        if self.async_tp is not None:
            return self.async_tp.gather_gemms(ctx, local, x, specs)
        fp8 = self.fp8_gather and not local.endswith(".bwd")
        y = self._f(ctx, local, x, fp8) if not local.endswith(".bwd") else self._g_bwd(ctx, local, x)
        outs: list[Idx] = []
        for spec in specs:
            extra = [outs[-1]] if spec.chained and outs else []
            outs.append(self.b.gemm(ctx, spec.name, self.tokens, spec.n, spec.k, [y] + extra,
                                    act_cast=not fp8))
        return y, outs

    def _gemms_rs(self, ctx: Ctx, local: str, deps: list, specs: list[GemmSpec], *,
                  backward: bool = False) -> Idx:
        """Row-parallel GEMMs (or a column-parallel GEMM's input gradient, ``backward``)
        followed by their all-reduce (TP) or reduce-scatter (SP), or their chunked fusion
        under async TP."""
        if self.async_tp is not None:
            return self.async_tp.gemms_scatter(ctx, local, deps, specs)
        out: Idx = None
        for spec in specs:
            extra = [out] if spec.chained and out is not None else []
            out = self.b.gemm(ctx, spec.name, self.tokens, spec.n, spec.k, list(deps) + extra)
        return self._f_bwd(ctx, local, out) if backward else self._g(ctx, local, out)

    # -- one layer -----------------------------------------------------------------
    def layer_forward(self, ctx: Ctx, x: Idx, *, early_stop: bool = False) -> Idx:
        """The layer's forward (``_layer_forward``), stamped when it may be; ``early_stop``:
        only up to fc2's input (a recomputation by torch.utils.checkpoint's non-reentrant
        implementation stops there: backward needs nothing the rest computes)."""
        body = partial(self._layer_forward, ctx, x, early_stop)
        if not self._stamps(ctx):
            return body()
        return self.stamper("layer_early" if early_stop else "layer", ctx, (x,), None, body)

    def layer_backward(self, ctx: Ctx, g: Idx, grads: dict[str, int], *,
                       recompute_attention: Idx = None, recompute=None) -> Idx:
        """The layer's backward (``_layer_backward``), stamped when it may be. ``recompute``
        (PyTorch's non-reentrant checkpoint): emits the layer's recomputation, which runs
        when fc2's backward first unpacks a saved tensor: after the output gradient's
        residual and (SP) gather, before fc2's GEMMs."""
        stamps = self._stamps(ctx)
        if recompute is not None:
            head = partial(self._backward_head, ctx, g)
            g = self.stamper("layer_head", ctx, (g,), None, head) if stamps else head()
            ready = recompute()
        else:
            ready = None
        body = partial(self._layer_backward, ctx, g, grads, recompute_attention=recompute_attention,
                       ready=ready)
        if not stamps:
            return body()
        key = "layer" if ready is None else "layer_rest"
        return self.stamper(key, ctx, (g, recompute_attention, ready), grads, body)

    def _backward_head(self, ctx: Ctx, g: Idx) -> Idx:
        """The output gradient's residual and (SP) gather: what a dense layer's backward runs
        before it needs a saved tensor."""
        g = self.b.elementwise(ctx, "resid2.bwd", self.local_tokens * self.h, [g], tensors=3)
        return self._g_bwd(ctx, "rs2.bwd" if self.sp else "ar2.bwd", g)

    def _layer_forward(self, ctx: Ctx, x: Idx, early_stop: bool = False) -> Idx:
        """norm1, [AG], QKV, attention, out-proj, [AR|RS], residual, norm2, [AG], MLP, [AR|RS],
        residual (``early_stop``: up to the MLP's activation; in a MoE layer up to its output,
        the experts' weighted combine being the last op that saves a tensor)."""
        b, n, lt = self.b, self.tokens, self.local_tokens
        x = b.elementwise(ctx, "norm1", lt * self.h, [x], tensors=2, flops_per_element=5, reduction=True)
        _, (x,) = self._ag_gemms(ctx, "ag1", x, [GemmSpec("qkv", self.q + 2 * self.kv, self.h)])
        if self.rope:  # rotate the queries and keys (read and write them once, fused)
            x = b.elementwise(ctx, "rope", n * (self.q + self.kv), [x], tensors=2,
                              flops_per_element=3)
        x = b.attention(ctx, "attn", self.mb, self.heads, self.kv_heads, self.model.seq_len,
                        self.d, [x], eager=self.eager) if self.cp is None else self.cp.forward(ctx, x)
        x = self._gemms_rs(ctx, "ar1" if not self.sp else "rs1", [x],
                           [GemmSpec("out_proj", self.h, self.q)])
        x = b.elementwise(ctx, "resid1", lt * self.h, [x], tensors=3)
        x = b.elementwise(ctx, "norm2", lt * self.h, [x], tensors=2, flops_per_element=5, reduction=True)
        if self.moe is not None and self.moe.is_moe(ctx.layer):
            x = self.moe.forward(ctx, x)  # (early_stop: its weighted combine saves the last)
            return x if early_stop else b.elementwise(ctx, "resid2", lt * self.h, [x], tensors=3)
        if self.model.activation == "swiglu":
            _, (g, u) = self._ag_gemms(ctx, "ag2", x, [GemmSpec("fc_gate", self.f, self.h),
                                                      GemmSpec("fc_up", self.f, self.h)])
            x = b.elementwise(ctx, "act", n * self.f, [g, u], tensors=3, flops_per_element=4)
        else:
            _, (x,) = self._ag_gemms(ctx, "ag2", x, [GemmSpec("fc1", self.f, self.h)])
            x = b.elementwise(ctx, "act", n * self.f, [x], tensors=2, flops_per_element=8)
        if early_stop:
            return x
        x = self._gemms_rs(ctx, "ar2" if not self.sp else "rs2", [x],
                           [GemmSpec("fc2", self.h, self.f)])
        return b.elementwise(ctx, "resid2", lt * self.h, [x], tensors=3)

    def _layer_backward(self, ctx: Ctx, g: Idx, grads: dict[str, int], *,
                        recompute_attention: Idx = None, ready: Idx = None) -> Idx:
        """The layer's backward in reverse order; dgrad before wgrad so the input-gradient
        all-reduce overlaps the weight gradient (Megatron). Fills ``grads`` with the op
        after which each local grad op's gradient is ready. ``ready``: the recomputation,
        emitted after ``_backward_head`` (``g`` is then the head's gathered gradient)."""
        b, n, lt = self.b, self.tokens, self.local_tokens
        if ready is not None:
            d = b.gemm(ctx, "fc2.dgrad", n, self.f, self.h, [g, ready])
        else:
            g = b.elementwise(ctx, "resid2.bwd", lt * self.h, [g], tensors=3)
            if self.moe is not None and self.moe.is_moe(ctx.layer):
                r = self.moe.backward(ctx, g, grads)
                return self._attention_backward(ctx, r, grads, recompute_attention)
            g, (d,) = self._ag_gemms(ctx, "rs2.bwd" if self.sp else "ar2.bwd", g,
                                     [GemmSpec("fc2.dgrad", self.f, self.h)])
        self._weight(grads, "fc2.wgrad", partial(b.gemm, ctx, "fc2.wgrad", self.f, self.h, n, [g]))
        if self.model.activation == "swiglu":
            a = b.elementwise(ctx, "act.bwd", n * self.f, [d], tensors=5, flops_per_element=8)
            r = self._gemms_rs(ctx, "ag2.bwd", [a], [GemmSpec("fc_gate.dgrad", self.h, self.f),
                                                     GemmSpec("fc_up.dgrad", self.h, self.f, True)],
                               backward=True)
            self._weight(grads, "fc_gate.wgrad",
                         partial(b.gemm, ctx, "fc_gate.wgrad", self.h, self.f, n, [a]))
            self._weight(grads, "fc_up.wgrad", partial(b.gemm, ctx, "fc_up.wgrad", self.h, self.f, n, [a]))
        else:
            a = b.elementwise(ctx, "act.bwd", n * self.f, [d], tensors=3, flops_per_element=8)
            r = self._gemms_rs(ctx, "ag2.bwd", [a], [GemmSpec("fc1.dgrad", self.h, self.f)],
                               backward=True)
            self._weight(grads, "fc1.wgrad", partial(b.gemm, ctx, "fc1.wgrad", self.h, self.f, n, [a]))
        return self._attention_backward(ctx, r, grads, recompute_attention)

    def _attention_backward(self, ctx: Ctx, r: Idx, grads: dict[str, int],
                            recompute_attention: Idx) -> Idx:
        """From the gradient ``r`` of norm2's output to the layer input's gradient."""
        b, n, lt = self.b, self.tokens, self.local_tokens
        g = b.elementwise(ctx, "norm2.bwd", lt * self.h, [r], tensors=3, flops_per_element=8, reduction=True)
        grads["norm2.bwd"] = g
        g = b.elementwise(ctx, "resid1.bwd", lt * self.h, [g], tensors=3)
        g, (d,) = self._ag_gemms(ctx, "rs1.bwd" if self.sp else "ar1.bwd", g,
                                 [GemmSpec("out_proj.dgrad", self.q, self.h)])
        self._weight(grads, "out_proj.wgrad", partial(b.gemm, ctx, "out_proj.wgrad", self.q, self.h, n, [g]))
        # backward of attention: 2x forward; flash attention recomputes the scores (+0.5x)
        scale = 2.5 if (self.par.flash_attention and recompute_attention is None) else 2.0
        a = b.attention(ctx, "attn.bwd", self.mb, self.heads, self.kv_heads, self.model.seq_len,
                        self.d, [d, recompute_attention], flops_scale=scale, eager=self.eager) \
            if self.cp is None else self.cp.backward(ctx, [d, recompute_attention], scale)
        if self.rope:  # the inverse rotation of the query and key gradients
            a = b.elementwise(ctx, "rope.bwd", n * (self.q + self.kv), [a], tensors=2,
                              flops_per_element=3)
        r = self._gemms_rs(ctx, "ag1.bwd", [a], [GemmSpec("qkv.dgrad", self.h, self.q + 2 * self.kv)],
                           backward=True)
        self._weight(grads, "qkv.wgrad",
                     partial(b.gemm, ctx, "qkv.wgrad", self.h, self.q + 2 * self.kv, n, [a]))
        g = b.elementwise(ctx, "norm1.bwd", lt * self.h, [r], tensors=3, flops_per_element=8, reduction=True)
        grads["norm1.bwd"] = g
        return g

    def attention_recompute(self, ctx: Ctx, x: Idx) -> int:
        """Selective recomputation: the attention core forward again (Korthikanti §5)."""
        if self.cp is not None:
            return self.cp.forward(ctx, x)
        return self.b.attention(ctx, "attn", self.mb, self.heads, self.kv_heads,
                                self.model.seq_len, self.d, [x], eager=self.eager)

    def op_recompute(self, ctx: Ctx, x: Idx) -> int:
        """torchtitan's op-level selective AC (``recompute=op``, cp = 1, dense): forward
        kept every other matmul's output (q, v, the gate or fc1, the down projection), the
        attention's and, under SP, the reduce-scatters' (its ``_save_list``); backward replays
        the forward in order as far as it needs (torch.utils.checkpoint stops early), running
        what was not kept: norm1, under SP its all-gather, the key projection and RoPE, the
        output projection (from the kept attention output), under plain TP its all-reduce
        (the reduce-scatter's output was kept), the residual, norm2, under SP its all-gather,
        then the up projection and SwiGLU (GeLU from the kept fc1: no matmul)."""
        b, n, lt = self.b, self.tokens, self.local_tokens
        x = b.elementwise(ctx, "norm1", lt * self.h, [x], tensors=2, flops_per_element=5, reduction=True)
        x = self._f(ctx, "ag1", x, self.fp8_gather)
        k = b.gemm(ctx, "k_proj", n, self.kv, self.h, [x], act_cast=not self.fp8_gather)
        if self.rope:
            k = b.elementwise(ctx, "rope", n * (self.q + self.kv), [k], tensors=2,
                              flops_per_element=3)
        o = b.gemm(ctx, "out_proj", n, self.h, self.q, [k])  # (its input kept; one stream)
        if not self.sp:
            o = self._g(ctx, "ar1", o)
        x = b.elementwise(ctx, "resid1", lt * self.h, [o], tensors=3)
        x = b.elementwise(ctx, "norm2", lt * self.h, [x], tensors=2, flops_per_element=5, reduction=True)
        x = self._f(ctx, "ag2", x, self.fp8_gather)
        if self.model.activation == "swiglu":
            u = b.gemm(ctx, "fc_up", n, self.f, self.h, [x], act_cast=not self.fp8_gather)
            return b.elementwise(ctx, "act", n * self.f, [u], tensors=3, flops_per_element=4)
        return b.elementwise(ctx, "act", n * self.f, [x], tensors=2, flops_per_element=8)

    # -- embedding and head ----------------------------------------------------------
    def embedding_forward(self, ctx: Ctx, x: Idx) -> Idx:
        """Vocab-parallel lookup; partial rows combined by all-reduce (TP) or
        reduce-scatter into sequence shards (SP)."""
        x = self.b.elementwise(ctx, "embed", self.tokens * self.h, [x], tensors=1)
        return self._g(ctx, "embed.rs" if self.sp else "embed.ar", x)

    def embedding_backward(self, ctx: Ctx, g: Idx, grads: dict[str, int]) -> int:
        g = self._g_bwd(ctx, "embed.ag.bwd", g)
        self._weight(grads, "embed.bwd", partial(self.b.elementwise, ctx, "embed.bwd",
                                                 self.tokens * self.h, [g], tensors=2))
        return grads.get("embed.bwd", g)  # the lookup's gradient is all weight gradient

    def head_forward(self, ctx: Ctx, x: Idx, *, with_loss: bool = True) -> Idx:
        """Final norm, [AG], vocab-parallel LM head, cross-entropy (3 small all-reduces)."""
        b, n = self.b, self.tokens
        x = b.elementwise(ctx, "final_norm", self.local_tokens * self.h, [x], tensors=2,
                          flops_per_element=5, reduction=True)
        x = self._f(ctx, "head.ag", x)
        x = b.gemm(ctx, "lm_head", n, self.vocab, self.h, [x])
        if not with_loss:
            return x
        x = b.elementwise(ctx, "loss", n * self.vocab, [x], tensors=2, flops_per_element=5,
                          reduction=True, compiled=b.compiled_loss)
        for stat in ("max", "sumexp", "target"):
            y = b.collective(ctx.at(paradigm=self.paradigm), f"ce.{stat}", "all_reduce",
                             self.group, "tp", 4 * n, [x], stream="comm.tp")
            x = x if y is None else y
        self.ce[ctx.mb] = x
        return x

    def head_backward(self, ctx: Ctx, g: Idx, grads: dict[str, int], *,
                      with_loss: bool = True) -> Idx:
        b, n = self.b, self.tokens
        if with_loss:
            g = b.elementwise(ctx, "loss.bwd", n * self.vocab, [g, self.ce.pop(ctx.mb, None)], tensors=2,
                              flops_per_element=4, reduction=True, compiled=b.compiled_loss)
        d = b.gemm(ctx, "lm_head.dgrad", n, self.h, self.vocab, [g])
        # tied on one stage, this gradient accumulates into the embedding's (ready at embed.bwd)
        self._weight(grads, "lm_head.wgrad",
                     partial(b.gemm, ctx, "lm_head.wgrad", self.h, self.vocab, n, [g]))
        r = self._f_bwd(ctx, "head.rs.bwd" if self.sp else "head.ar.bwd", d)
        g = b.elementwise(ctx, "final_norm.bwd", self.local_tokens * self.h, [r], tensors=3,
                          flops_per_element=8, reduction=True)
        grads["final_norm.bwd"] = g
        return g
