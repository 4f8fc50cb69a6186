"""Mixture-of-experts layers with expert parallelism: router, token dispatch, grouped expert
GEMMs, combine, their backward, and the experts' own gradient sync.

Per MoE layer, on the n tokens this rank routes (b*s, or b*s/t under sequence parallelism),
after Megatron-Core's all-to-all token dispatcher (MoEAlltoAllTokenDispatcher):

    router GEMM n x h @ h x E -> softmax / top-k (+ the auxiliary loss) -> permute the n*k
    token copies by expert -> all-to-all dispatch over EP (bytes per peer from the routing
    model, twin/workload/moe.py) -> all-gather over ETP -> grouped GEMMs over the R tokens the
    local experts received (fc1: R x h @ h x m f_e/etp, activation, fc2: R x f_e/etp @
    f_e/etp x h) -> reduce-scatter over ETP -> all-to-all combine (the dispatch reversed) ->
    unpermute and weight (n*k copies into n rows)

and the shared experts as one dense MLP under TP (column/row parallel, with SP's all-gather
and reduce-scatter), added to the routed output. Backward mirrors it: combine's and
dispatch's gradients are all-to-alls in the opposite directions, ETP's reduce-scatter
becomes an all-gather and the reverse; dgrad before wgrad. With tp > 1 and no SP (only ep=1,
etp=tp: build_job checks it) tokens are replicated over TP, the experts TP-split as the dense
MLP and their output all-reduced. Expert gradients are reduced over the expert-data-parallel
group (twin/spec/experts.py) by ``apply_expert_dp``, unless ep=1 and etp=tp, when that group
is the dense DP group and the dense pass reduces them with the rest.
"""

from __future__ import annotations

from functools import partial

from twin.schedule.data import GradSync, assign_buckets
from twin.schedule.emit import Ctx, Idx, ProgramBuilder
from twin.schedule.stage import StageLayout
from twin.spec import Job
from twin.spec.experts import expert_grid, has_expert_groups
from twin.workload.moe import Traffic, traffic
from twin.workload.moememory import layer_activation_delta
from twin.workload.params import expert_tensors

STREAM = "comm.ep"


def apply_moe(out: ProgramBuilder, job: Job, rank: int, tp) -> MoELayers | None:
    """The MoE layer builder the TP pass calls for MoE layers; None for a dense model."""
    return None if job.model.moe is None else MoELayers(out, job, rank, tp)


class MoELayers:
    """Emits the MLP part of a MoE layer for one rank (see the module docstring)."""

    def __init__(self, out: ProgramBuilder, job: Job, rank: int, tp):
        self.b, self.tp = out, tp
        self.model, self.par = model, par = job.model, job.parallel
        self.moe = moe = model.moe
        grid = expert_grid(job.grid, par)
        self.ep, self.etp = par.ep, par.expert_tp
        self.ep_group, self.etp_group = grid.group(rank, "ep"), grid.group(rank, "etp")
        self.ep_rank = grid.coords(rank)["ep"]
        self.replicated = par.tp > 1 and not par.sp  # tokens whole on every TP rank
        self.n = tp.local_tokens  # tokens this rank routes
        self.h = model.hidden_size
        self.swiglu = model.activation == "swiglu"
        self.m = 2 if self.swiglu else 1
        self.fe = moe.moe_ffn_hidden_size // self.etp
        self.fs = moe.shared_ffn_hidden_size // par.tp
        self.row = out.e * self.h  # bytes of one token's hidden state

    def is_moe(self, layer: int) -> bool:
        return self.moe.is_moe_layer(layer)

    def traffic(self, layer: int) -> Traffic:
        return traffic(self.moe, layer, self.n, self.ep, self.ep_rank)

    def expert_tokens(self, t: Traffic) -> int:
        """R: rows of the grouped GEMMs (received tokens, gathered over ETP)."""
        gathered = self.etp > 1 and not self.replicated
        return t.received * (self.etp if gathered else 1)

    def _wgrad(self, ctx: Ctx, grads: dict[str, int], local: str, m: int, n: int, k: int,
               deps: list[Idx]) -> None:
        """A weight-gradient GEMM, through the TP pass (held back under a split backward)."""
        self.tp._weight(grads, local, partial(self.b.gemm, ctx, local, m, n, k, deps))

    def activation_delta(self, layer: int, policy: str) -> float:
        """Bytes a MoE layer keeps for backward beyond a dense layer's, per micro-batch
        (twin/workload/moememory.py); 0 for a dense layer of a MoE model."""
        if not self.is_moe(layer):
            return 0.0
        rows = self.expert_tokens(self.traffic(layer))
        return layer_activation_delta(self.model, self.par, policy, rows)

    # -- collectives ---------------------------------------------------------------
    def _a2a(self, ctx: Ctx, local: str, send: tuple[int, ...], recv: tuple[int, ...],
             copies: int, x: Idx) -> Idx:
        """All-to-all over EP: ``send``/``recv`` token copies per peer; uneven sizes carry
        per-peer byte lists (Op.send_splits / recv_splits). ``bytes``: the mean send buffer
        over the members, ``copies`` rows (every source's routed copies), the same on every
        member as a collective's size must be; a rank's own is sum(send_splits)."""
        if self.ep == 1:
            return x
        even = len(set(send)) == 1 and len(set(recv)) == 1
        splits = {} if even else {"send_splits": tuple(float(c * self.row) for c in send),
                                  "recv_splits": tuple(float(c * self.row) for c in recv)}
        return self.b.emit(ctx.at(paradigm="ep"), local, "all_to_all", STREAM, [x],
                           group=self.ep_group, group_name="ep",
                           bytes=float(copies * self.row), dtype=self.b.dtype, **splits)

    def _etp(self, ctx: Ctx, local: str, kind: str, rows: int, x: Idx) -> Idx:
        """All-gather or reduce-scatter of ``rows`` gathered tokens over ETP (or, with
        replicated tokens, the TP all-reduce of the expert output)."""
        if self.replicated:
            if kind != "all_reduce":
                return x
            group, name = self.tp.group, "tp"
        else:
            if kind == "all_reduce":
                return x
            group, name = self.etp_group, "etp"
        y = self.b.collective(ctx.at(paradigm="ep"), local, kind, group, name,
                              rows * self.row, [x], stream=STREAM)
        return x if y is None else y

    # -- forward -------------------------------------------------------------------
    def forward(self, ctx: Ctx, x: Idx) -> Idx:
        """The MoE MLP on the output ``x`` of norm2; returns the op producing its output."""
        b, moe, n, h = self.b, self.moe, self.n, self.h
        e = moe.num_experts
        t = self.traffic(ctx.layer)
        r = self.expert_tokens(t)
        shared = self._shared_forward(ctx, x)
        g = b.gemm(ctx, "router", n, e, h, [x])
        g = b.elementwise(ctx, "router.topk", n * e, [g], tensors=2, flops_per_element=5)
        if moe.router_aux_loss:
            g = b.elementwise(ctx, "router.aux", n * e, [g], tensors=1, flops_per_element=2)
        p = b.elementwise(ctx, "moe.permute", t.sent * h, [g, x], tensors=2, flops_per_element=0)
        p = self._a2a(ctx, "moe.dispatch", t.send, t.recv, t.sent, p)
        p = self._etp(ctx, "moe.ag", "all_gather", r, p)
        y = b.gemm(ctx, "experts.fc1", r, self.m * self.fe, h, [p])
        y = b.elementwise(ctx, "experts.act", r * self.fe, [y], tensors=3 if self.swiglu else 2,
                          flops_per_element=4 if self.swiglu else 8)
        y = b.gemm(ctx, "experts.fc2", r, h, self.fe, [y])
        y = self._etp(ctx, "moe.rs", "reduce_scatter", r, y)
        y = self._a2a(ctx, "moe.combine", t.recv, t.send, t.sent, y)
        y = b.elementwise(ctx, "moe.unpermute", t.sent * h, [y], tensors=2, flops_per_element=2)
        y = self._etp(ctx, "moe.ar", "all_reduce", n, y)
        if shared is None:
            return y
        return b.elementwise(ctx, "moe.add", n * h, [y, shared], tensors=3)

    def _shared_forward(self, ctx: Ctx, x: Idx) -> Idx:
        """Shared experts: one TP-split MLP of s * f_e on every token (Megatron's
        SharedExpertMLP: SP's all-gather before, all-reduce or reduce-scatter after)."""
        if not self.moe.shared_experts:
            return None
        b, tp, n, fs = self.b, self.tp, self.tp.tokens, self.fs
        x = tp._f(ctx, "shared.ag", x)
        if self.swiglu:
            g = b.gemm(ctx, "shared.fc_gate", n, fs, self.h, [x])
            u = b.gemm(ctx, "shared.fc_up", n, fs, self.h, [x])
            x = b.elementwise(ctx, "shared.act", n * fs, [g, u], tensors=3, flops_per_element=4)
        else:
            x = b.gemm(ctx, "shared.fc1", n, fs, self.h, [x])
            x = b.elementwise(ctx, "shared.act", n * fs, [x], tensors=2, flops_per_element=8)
        x = b.gemm(ctx, "shared.fc2", n, self.h, fs, [x])
        return tp._g(ctx, "shared.rs" if tp.sp else "shared.ar", x)

    # -- backward ------------------------------------------------------------------
    def backward(self, ctx: Ctx, g: Idx, grads: dict[str, int]) -> Idx:
        """The MoE MLP's backward from the gradient ``g`` of its output; returns the op
        producing the gradient of norm2's output. Fills ``grads`` (router, experts, shared)."""
        b, moe, n, h = self.b, self.moe, self.n, self.h
        e = moe.num_experts
        t = self.traffic(ctx.layer)
        r = self.expert_tokens(t)
        shared = self._shared_backward(ctx, g, grads)
        d = b.elementwise(ctx, "moe.unpermute.bwd", t.sent * h, [g], tensors=2,
                          flops_per_element=2)
        d = self._a2a(ctx, "moe.combine.bwd", t.send, t.recv, t.sent, d)
        d = self._etp(ctx, "moe.rs.bwd", "all_gather", r, d)
        a = b.gemm(ctx, "experts.fc2.dgrad", r, self.fe, h, [d])
        self._wgrad(ctx, grads, "experts.fc2.wgrad", self.fe, h, r, [d])
        a = b.elementwise(ctx, "experts.act.bwd", r * self.fe, [a],
                          tensors=5 if self.swiglu else 3, flops_per_element=8)
        d = b.gemm(ctx, "experts.fc1.dgrad", r, h, self.m * self.fe, [a])
        self._wgrad(ctx, grads, "experts.fc1.wgrad", h, self.m * self.fe, r, [a])
        d = self._etp(ctx, "moe.ag.bwd", "reduce_scatter", r, d)
        d = self._a2a(ctx, "moe.dispatch.bwd", t.recv, t.send, t.sent, d)
        d = b.elementwise(ctx, "moe.permute.bwd", t.sent * h, [d], tensors=2, flops_per_element=1)
        if self.replicated:  # the experts saw replicated tokens: partial input gradients
            d = self.tp._f_bwd(ctx, "moe.ar.bwd", d)
        s = d
        if moe.router_aux_loss:
            s = b.elementwise(ctx, "router.aux.bwd", n * e, [s], tensors=2, flops_per_element=2)
        s = b.elementwise(ctx, "router.topk.bwd", n * e, [s], tensors=3, flops_per_element=5)
        r_in = b.gemm(ctx, "router.dgrad", n, h, e, [s])
        self._wgrad(ctx, grads, "router.wgrad", h, e, n, [s])
        return b.elementwise(ctx, "moe.grad_sum", n * h, [d, r_in, shared],
                             tensors=4 if shared is not None else 3)

    def _shared_backward(self, ctx: Ctx, g: Idx, grads: dict[str, int]) -> Idx:
        if not self.moe.shared_experts:
            return None
        b, tp, n, fs, h = self.b, self.tp, self.tp.tokens, self.fs, self.h
        g = tp._g_bwd(ctx, "shared.rs.bwd" if tp.sp else "shared.ar.bwd", g)
        d = b.gemm(ctx, "shared.fc2.dgrad", n, fs, h, [g])
        self._wgrad(ctx, grads, "shared.fc2.wgrad", fs, h, n, [g])
        if self.swiglu:
            a = b.elementwise(ctx, "shared.act.bwd", n * fs, [d], tensors=5, flops_per_element=8)
            d1 = b.gemm(ctx, "shared.fc_gate.dgrad", n, h, fs, [a])
            d2 = b.gemm(ctx, "shared.fc_up.dgrad", n, h, fs, [a, d1])
            r = tp._f_bwd(ctx, "shared.ag.bwd", d2)
            self._wgrad(ctx, grads, "shared.fc_gate.wgrad", h, fs, n, [a])
            self._wgrad(ctx, grads, "shared.fc_up.wgrad", h, fs, n, [a])
        else:
            a = b.elementwise(ctx, "shared.act.bwd", n * fs, [d], tensors=3, flops_per_element=8)
            d1 = b.gemm(ctx, "shared.fc1.dgrad", n, h, fs, [a])
            r = tp._f_bwd(ctx, "shared.ag.bwd", d1)
            self._wgrad(ctx, grads, "shared.fc1.wgrad", h, fs, n, [a])
        return r


def apply_expert_dp(out: ProgramBuilder, job: Job, rank: int,
                    layout: StageLayout) -> GradSync | None:
    """The routed experts' gradient buckets over their expert-data-parallel group (DDP's
    all-reduce, or ZeRO-1/2's reduce-scatter and parameter all-gather, as the dense pass);
    None for a dense model, when the experts live on the dense groups (ep=1, etp=tp: the
    dense pass has them), or when each expert has one copy (edp=1)."""
    model, par = job.model, job.parallel
    if model.moe is None or (par.ep == 1 and par.expert_tp == par.tp) or par.zero_stage > 2:
        return None
    grid = expert_grid(job.grid, par)
    if grid.edp == 1:
        return None
    tensors, grad_ops = [], {}
    for layer in job.layers_on_stage(layout.stage):
        if model.moe.is_moe_layer(layer):
            for t in expert_tensors(model, par.ep, par.expert_tp):
                tensors.append(((layer, t.name), t.numel))
                grad_ops[(layer, t.name)] = t.grad_op
    if not tensors:
        return None
    ddp = par.zero_stage == 0
    buckets = assign_buckets(tensors, out.e, par.ddp_bucket_MB, None if ddp else 1024 * 1024)
    return GradSync(out, grid.group(rank, "edp"), buckets, grad_ops,
                    kind="all_reduce" if ddp else "reduce_scatter",
                    every_mb=par.sync_every_microbatch, last_mb=par.num_microbatches - 1,
                    paradigm="ep", role="edp", prefix="expert.")


def expert_norm_group(job: Job, rank: int) -> tuple[tuple[int, ...], str] | None:
    """The group over which the routed experts' squared gradients are summed for clipping, and
    its name: etp x ep x pp (+ edp under ZeRO-1/2, as the dense norm adds dp), or None when the
    experts live on the dense groups (the dense norm's all-reduce has them). Megatron-Core
    keeps the experts in an optimizer of their own whose grad norm is all-reduced over
    ``expert_tensor_model_pipeline_parallel_group``; ChainedOptimizer.get_grad_norm combines
    it with the dense one as sqrt(d^2 + e^2) (megatron/core/optimizer/optimizer.py). Without it
    each EP rank would clip by its own experts' norm and the dense replicas would diverge."""
    model, par = job.model, job.parallel
    if not has_expert_groups(model, par):
        return None
    grid = expert_grid(job.grid, par)
    dims = ("etp", "ep") + (("edp",) if par.zero_stage >= 1 else ())
    ranks = {rank}
    for d in dims:
        ranks = {m for r in ranks for m in grid.group(r, d)}
    ranks = {m for r in ranks for m in job.grid.group(r, ("pp",))}
    return tuple(sorted(ranks)), "-".join(dims + ("pp",))
