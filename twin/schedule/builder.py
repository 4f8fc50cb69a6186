"""Build one rank's program: TP inside PP stages inside DP/ZeRO replicas, for any rank order.

The composition, in order (what each rank does in one optimizer step):
1. setup: allocate the model states this rank keeps (parameters, gradients, optimizer
   states, sharded per ZeRO stage);
2. the pipeline table of its stage (GPipe, 1F1B or interleaved; one stage without PP):
   for each forward, receive the activation (not on the first chunk), run the chunk's
   layers (embedding on the first chunk, head and loss on the last) with their TP/SP
   collectives and FSDP gathers, send the activation on; for each backward the reverse,
   with recomputation first when asked, and DDP/ZeRO gradient collectives as buckets fill;
3. step end: under SP, when ``sp_norm_grad_sync`` asks, the all-reduce over TP of the
   norm weights' gradients (each rank saw only its sequence shard), the tied-embedding
   all-reduce between the first and last stage, the gradient-norm all-reduce for
   clipping, the optimizer step on the local shard, and ZeRO-1/2's parameter all-gather.
"""

from __future__ import annotations

from twin.schedule.data import GradSync
from twin.schedule.emit import Ctx, Idx, ProgramBuilder
from twin.schedule.ir import Op, Program, Schedule
from twin.schedule.pipeline import stage_order
from twin.schedule.sharded import FSDP, ROOT
from twin.schedule.tensor import TensorParallel
from twin.spec import Job
from twin.workload.memory import activation_bytes_per_layer, model_state_bytes
from twin.workload.params import embedding_tensors, head_tensors, layer_tensors, stage_params, vocab_rows

HEAD = -2  # tensor key of the head's parameters


def build_schedule(job: Job) -> Schedule:
    """A schedule whose programs are built per rank on demand."""
    from twin.schedule.legacy import legacy_dp_program

    if job.parallel.legacy_dp:
        return Schedule(job, builder=legacy_dp_program)
    return Schedule(job, builder=TemplateBuilder(job))


class TemplateBuilder:
    """Builds one program per pipeline stage and derives the other ranks' by translation.

    All ranks of a stage run the same ops; only the global ranks inside them differ. A
    rank's program is its stage template with every group, peer and root moved by the
    rank's offset on the grid (coordinates shifted modulo each axis), groups re-sorted
    into the grid's canonical (ascending) order. Compute and memory ops are shared."""

    def __init__(self, job: Job):
        self.job = job
        self.templates: dict[int, Program] = {}

    def __call__(self, job: Job, rank: int) -> Program:
        grid = job.grid
        stage = grid.coord(rank, "pp")
        t = self.templates.get(stage)
        if t is None:
            t = self.templates[stage] = build_program(job, rank)
            t.template = rank
            return t
        if t.rank == rank:
            return t
        delta = {d: grid.coord(rank, d) - grid.coord(t.rank, d) for d in grid.order}
        memo: dict[int, int] = {}

        def move(m: int) -> int:
            if m < 0:
                return m
            r = memo.get(m)
            if r is None:
                r = memo[m] = grid.rank(**{d: (grid.coord(m, d) + delta[d]) % grid.size(d)
                                           for d in grid.order})
            return r

        groups: dict[tuple, tuple] = {}
        ops = []
        for op in t.ops:
            if op.group or op.peer >= 0 or op.root >= 0:
                g = groups.get(op.group)
                if g is None:
                    g = groups[op.group] = tuple(sorted(move(m) for m in op.group))
                op = Op(op.name, op.kind, op.stream, op.deps, op.phase, op.paradigm, op.layer,
                        op.mb, op.chunk, op.shape, op.dtype, op.flops, op.bytes, g, op.group_name,
                        move(op.root), move(op.peer), op.tag, op.category)
            ops.append(op)
        return Program(rank, ops, template=t.rank)


class StepBuilder:
    """Emits one rank's step; see the module docstring for the order."""

    def __init__(self, job: Job, rank: int):
        self.job, self.rank = job, rank
        self.b = ProgramBuilder(job, rank)
        self.tp = TensorParallel(self.b)
        par, grid, model = job.parallel, job.grid, job.model
        self.par, self.model = par, model
        self.stage = grid.coord(rank, "pp")
        self.pp_group = grid.group(rank, "pp")
        self.first = self.stage == 0
        self.last = self.stage == par.pp - 1
        self.n_chunks = par.num_stages
        starts = [0]
        for n in job.stage_layers:
            starts.append(starts[-1] + n)
        self.chunk_layers = [range(starts[c], starts[c + 1]) for c in range(self.n_chunks)]
        sp_div = par.tp if par.sp else 1
        self.p2p_bytes = self.b.e * par.micro_batch_size * model.seq_len * model.hidden_size / sp_div
        self.sp_div = sp_div
        self._tensors()
        self._head_grads: list[int] = []
        self.sync: GradSync | None = None
        self.fsdp: FSDP | None = None
        every = par.sync_every_microbatch
        if par.legacy_dp:
            pass  # nn.DataParallel reduces gradients to device 0 itself (schedule/legacy.py)
        elif par.dp > 1 and par.zero_stage in (0, 1, 2):
            kind = "all_reduce" if par.zero_stage == 0 else "reduce_scatter"
            paradigm = "ddp" if par.zero_stage == 0 else f"zero{par.zero_stage}"
            self.sync = GradSync(self.b, self.tensors, self.grad_ops, kind, every, paradigm)
        elif par.dp > 1 and par.zero_stage == 3:
            self.fsdp = FSDP(self.b, self.units, every)

    def _tensors(self) -> None:
        """Registration-ordered (key, numel) of the stage's tensors, their grad ops, FSDP units."""
        model, tp = self.model, self.par.tp
        self.tensors, self.grad_ops = [], {}
        self.units: dict[int, int] = {}
        tied_copy = self.par.pp > 1 and model.tie_embeddings

        def add(layer: int, ts, unit: int) -> None:
            for t in ts:
                self.tensors.append(((layer, t.name), t.numel))
                self.grad_ops[(layer, t.name)] = t.grad_op
                self.units[unit] = self.units.get(unit, 0) + t.numel

        if self.first:
            add(ROOT, embedding_tensors(model, tp), ROOT)
        for layer in self.job.layers_on_stage(self.stage):
            add(layer, layer_tensors(model, tp), layer)
        if self.last:
            add(HEAD, head_tensors(model, tp, holds_copy=tied_copy), ROOT)

    # -- setup -----------------------------------------------------------------------
    def setup(self) -> None:
        states = model_state_bytes(stage_params(self.job, self.stage), self.par.dp,
                                   self.par.zero_stage, self.model.dtype)
        ctx = Ctx("setup")
        for cat in ("params", "grads", "optimizer"):
            self.b.alloc(ctx, f"model.{cat}", cat, getattr(states, cat))

    # -- forward ---------------------------------------------------------------------
    def _layer_acts(self, recompute: str) -> float:
        p = self.par
        return activation_bytes_per_layer(self.model, p.micro_batch_size, p.tp, p.sp, recompute,
                                          p.flash_attention)

    def _head_act_bytes(self) -> float:
        m, p = self.model, self.par
        sb = m.seq_len * p.micro_batch_size
        return 2 * self.b.e * sb * m.hidden_size / self.sp_div + 4 * sb * vocab_rows(m, p.tp)

    def forward(self, mb: int, chunk: int) -> None:
        b, tp = self.b, self.tp
        ctx = Ctx("fwd", mb=mb, chunk=chunk)
        x: Idx = None
        if chunk > 0:
            peer = self.pp_group[(chunk - 1) % self.par.pp]
            x = b.recv(ctx.at(paradigm="pp"), "recv", peer, f"act.c{chunk - 1}.mb{mb}",
                       self.p2p_bytes, [b.last_compute])
        layers = self.chunk_layers[chunk]
        if chunk == 0:
            ag = self.fsdp.before(ctx, ROOT, layers[0] if layers else None) if self.fsdp else None
            if self.model.dropout:
                sbh = self.model.seq_len * self.par.micro_batch_size * self.model.hidden_size
                b.alloc(ctx, f"act.embed.mb{mb}", "activations", sbh / self.sp_div)
            x = tp.embedding_forward(ctx, [x, ag])
        for i, layer in enumerate(layers):
            lctx = ctx.at(layer=layer)
            ag = None
            if self.fsdp:
                nxt = layers[i + 1] if i + 1 < len(layers) else None
                ag = self.fsdp.before(lctx, layer, nxt)
            kind = "full" if self.par.recompute == "full" else self.par.recompute
            b.alloc(lctx, f"act.L{layer}.mb{mb}", "activations", self._layer_acts(kind))
            x = tp.layer_forward(lctx, [x, ag])
            if self.fsdp:
                self.fsdp.after_forward(lctx, layer, x)
        if chunk == self.n_chunks - 1:
            ag = self.fsdp.before(ctx, ROOT, None) if self.fsdp else None
            b.alloc(ctx, f"act.head.mb{mb}", "activations", self._head_act_bytes())
            tp.head_forward(ctx, [x, ag])
        else:
            peer = self.pp_group[(chunk + 1) % self.par.pp]
            b.send(ctx.at(paradigm="pp"), "send", peer, f"act.c{chunk}.mb{mb}", self.p2p_bytes, [x])

    # -- backward --------------------------------------------------------------------
    def backward(self, mb: int, chunk: int) -> None:
        b, tp, par = self.b, self.tp, self.par
        ctx = Ctx("bwd", mb=mb, chunk=chunk)
        layers = self.chunk_layers[chunk]
        if chunk == self.n_chunks - 1:
            grads: dict[str, int] = {}
            ag = None
            if self.fsdp:
                ag = self.fsdp.before(ctx, ROOT, None)
                self.fsdp.begin_backward(ctx, ROOT)
            g = tp.head_backward(ctx, [b.last_compute, ag], grads)
            b.free(ctx, f"act.head.mb{mb}", "activations", self._head_act_bytes(), [g])
            if self.sync:
                self.sync.grads_ready(HEAD, grads, mb)
            self._head_grads = list(grads.values())
            if self.fsdp and chunk != 0:
                self.fsdp.after_backward(ctx, ROOT, self._head_grads, g)
        else:
            peer = self.pp_group[(chunk + 1) % par.pp]
            g = b.recv(ctx.at(paradigm="pp"), "recv", peer, f"grad.c{chunk + 1}.mb{mb}",
                       self.p2p_bytes, [b.last_compute])
        for i, layer in enumerate(reversed(layers)):
            lctx = ctx.at(layer=layer)
            ag = None
            if self.fsdp:
                rest = list(reversed(layers))
                nxt = rest[i + 1] if i + 1 < len(rest) else None
                ag = self.fsdp.before(lctx, layer, nxt)
                self.fsdp.begin_backward(lctx, layer)
            r: Idx = None
            if par.recompute == "full":
                rctx = Ctx("recompute", mb=mb, chunk=chunk, layer=layer)
                b.alloc(rctx, f"ract.L{layer}.mb{mb}", "activations", self._layer_acts("none"))
                g = tp.layer_forward(rctx, [g, ag])
            elif par.recompute == "selective":
                r = tp.attention_recompute(Ctx("recompute", mb=mb, chunk=chunk, layer=layer),
                                           [g, ag])
            grads = {}
            g = tp.layer_backward(lctx, [g, ag], grads, recompute_attention=r)
            kind = "full" if par.recompute == "full" else par.recompute
            b.free(lctx, f"act.L{layer}.mb{mb}", "activations", self._layer_acts(kind), [g])
            if par.recompute == "full":
                b.free(lctx, f"ract.L{layer}.mb{mb}", "activations", self._layer_acts("none"), [g])
            if self.sync:
                self.sync.grads_ready(layer, grads, mb)
            if self.fsdp:
                self.fsdp.after_backward(lctx, layer, list(grads.values()), g)
        if chunk == 0:
            grads = {}
            ag = self.fsdp.before(ctx, ROOT, None) if self.fsdp else None
            g = tp.embedding_backward(ctx, [g, ag], grads)
            if self.model.dropout:
                sbh = self.model.seq_len * par.micro_batch_size * self.model.hidden_size
                b.free(ctx, f"act.embed.mb{mb}", "activations", sbh / self.sp_div, [g])
            if self.sync:
                self.sync.grads_ready(ROOT, grads, mb)
            if self.fsdp:  # with one chunk the root holds the head too: wait for its grads as well
                self.fsdp.begin_backward(ctx, ROOT)
                head = self._head_grads if self.n_chunks == 1 else []
                self.fsdp.after_backward(ctx, ROOT, [g] + head, g)
        else:
            peer = self.pp_group[(chunk - 1) % par.pp]
            b.send(ctx.at(paradigm="pp"), "send", peer, f"grad.c{chunk}.mb{mb}",
                   self.p2p_bytes, [g])

    # -- step end ----------------------------------------------------------------------
    def step_end(self) -> None:
        b, par, grid = self.b, self.par, self.job.grid
        ctx = Ctx("opt")
        waits: list[Idx] = [b.last_compute]
        if self.sync:
            waits += self.sync.finish()
        if self.fsdp:
            waits += self.fsdp.issued
        if par.sp and par.sp_norm_grad_sync != "none":
            waits += self.sp_norm_grads(ctx.at(paradigm="sp"), waits)
        if par.pp > 1 and self.model.tie_embeddings and (self.first or self.last):
            pair = (self.pp_group[0], self.pp_group[-1])
            n = vocab_rows(self.model, par.tp) * self.model.hidden_size
            shard = par.dp if par.zero_stage >= 2 else 1
            waits.append(b.collective(ctx.at(paradigm="pp"), "embd.ar", "all_reduce", pair,
                                      "embd", n * b.e / shard, waits))
        dims = ["tp", "pp"] + (["dp"] if par.zero_stage >= 1 else [])
        norm_group = grid.group(self.rank, dims)
        norm = b.collective(ctx, "grad_norm.ar", "all_reduce", norm_group, "-".join(dims), 4,
                            waits, stream="comm")
        params = stage_params(self.job, self.stage)
        local = -(-params // par.dp) if par.zero_stage >= 1 else params
        step = b.optimizer(ctx, "adam", local, [norm] + waits)
        if self.sync and par.zero_stage in (1, 2):
            self.sync.gather_params(ctx.at(paradigm=f"zero{par.zero_stage}"), step)

    def sp_norm_grads(self, ctx: Ctx, deps: list[Idx]) -> list[Idx]:
        """SP: all-reduce the replicated norm tensors' gradients over TP.

        Under SP a norm sees s/t of the sequence, so its weight gradient is a partial sum
        (Korthikanti et al. 2022, §4.2.2). per_tensor: one call per tensor (PyTorch's
        DTensor SequenceParallel); coalesced: one call for all (Megatron's
        finalize_model_grads), the same bytes."""
        norms = [(key, n) for key, n in self.tensors
                 if key[1].startswith(("norm1.", "norm2.", "final_norm."))]
        if self.par.sp_norm_grad_sync == "coalesced":
            return [self.b.collective(ctx, "sp.norm_grads.ar", "all_reduce", self.tp.group, "tp",
                                      sum(n for _, n in norms) * self.b.e, deps, stream="comm.tp")]
        return [self.b.collective(ctx, f"sp.{'head' if layer == HEAD else f'L{layer}'}.{name}.ar",
                                  "all_reduce", self.tp.group, "tp", n * self.b.e, deps,
                                  stream="comm.tp")
                for (layer, name), n in norms]

    def build(self) -> Program:
        self.setup()
        order = stage_order(self.par.pp_schedule, self.par.pp, self.par.num_microbatches,
                            self.stage, self.par.pp_virtual_stages)
        for action in order:
            (self.forward if action.phase == "F" else self.backward)(action.mb, action.chunk)
        self.step_end()
        return self.b.program()


def build_program(job: Job, rank: int) -> Program:
    """One rank's program for one optimizer step."""
    return StepBuilder(job, rank).build()
