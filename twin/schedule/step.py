"""Build one rank's program for one optimizer step by applying the paradigms' passes in order.

What a rank does in one step:
1. setup: allocate the model states this rank keeps (parameters, gradients, optimizer
   states, sharded per ZeRO stage);
2. the pipeline table of its stage (GPipe, 1F1B, interleaved, ZB-H1, ZB-V, DualPipeV or a
   torch CSV table; one stage without PP): each forward receives its chunk's input (not
   on the first chunk), runs the chunk's units (embedding on the first chunk, its layers,
   final norm, head and loss on the last) and sends the output on; each backward the
   reverse. A split backward runs as I (the input gradient: activation-gradient GEMMs and
   the memory-bound backward ops, sent on at once) and later W (the weight-gradient GEMMs,
   then what follows a unit's backward: gradient buckets, activation frees);
3. step end: the gradient collectives still in flight, the gradients' final reductions
   (SP's norm weights, PP's tied embedding), the gradient-norm all-reduce for clipping,
   the optimizer step on the local shard, and ZeRO-1/2's parameter all-gather.

Every paradigm's ops come from its own pass (see ``StepBuilder.__init__`` for the order).
"""

from __future__ import annotations

from collections.abc import Iterator

from twin.schedule.actions import ActionStamper
from twin.schedule.context import apply_cp
from twin.schedule.data import apply_dp
from twin.schedule.emit import Ctx, Idx, ProgramBuilder
from twin.schedule.ir import Program
from twin.schedule.moe import apply_expert_dp, apply_moe, expert_norm_group
from twin.schedule.p2p import apply_pp
from twin.schedule.passes import EMBED, HEAD_UNIT, LAYER, Pass, Unit
from twin.schedule.pipeline import SPLIT_SCHEDULES, Action, interleaved_warmup, stage_order
from twin.schedule.recompute import apply_ac
from twin.schedule.sharded import apply_fsdp
from twin.schedule.stage import HEAD, ROOT, stage_layout
from twin.schedule.tables import job_tables
from twin.schedule.tensor import apply_tp
from twin.schedule.zerobubble import post_recvs
from twin.spec import Job
from twin.workload.context import dp_dims, local_model
from twin.workload.memory import model_state_bytes
from twin.workload.moememory import expert_state_delta, optimizer_params
from twin.workload.params import stage_params


class StepBuilder:
    """Emits one rank's step; see the module docstring for what, ``__init__`` for the passes."""

    def __init__(self, job: Job, rank: int):
        self.job, self.rank = job, rank
        par, grid = job.parallel, job.grid
        model = local_model(job.model, par)  # under CP the passes see the s/cp tokens a rank holds
        self.b = b = ProgramBuilder(job, rank)
        self.stage = grid.coord(rank, "pp")
        self.layout = layout = stage_layout(job, self.stage)
        dp_group = grid.group(rank, dp_dims(par))  # dp, or dp x cp under CP
        self.tp = apply_tp(b, model, par, grid.group(rank, "tp"), layout.tensors)
        self.tp.moe = apply_moe(b, job, rank, self.tp)  # MoE layers' experts (None: dense)
        self.tp.cp = apply_cp(b, job, rank)  # CP's attention core over the CP group (None: cp=1)
        self.pp = apply_pp(b, model, par, grid.group(rank, "pp"), self.stage, job.placement)
        self.held: dict[tuple[int, int], list] = {}  # (mb, chunk) -> I's units, W ops held
        # The passes, in the order they are applied (torchtitan's parallelize: apply_tp ->
        # apply_ac -> apply_fsdp or apply_ddp). Each later pass wraps the earlier ones
        # around every unit, as module wrappers nest: its ``before`` runs first and its
        # ``after`` last. So TP is the body itself; recomputation re-runs that body (with
        # its TP collectives) inside the data-parallel pass, which needs the recomputed
        # forward done and the gradients made before it issues buckets, and FSDP gathers a
        # unit's parameters before anything inside uses them and reshards after all of
        # it. DDP/ZeRO-1/2 and FSDP exclude each other. The pipeline is outermost: it
        # works at chunk boundaries (``receive``/``send``), not around units; at step end
        # its tied-embedding all-reduce comes after SP's norm gradients.
        candidates: list[Pass | None] = [
            self.tp,                              # tensor (+ sequence) parallelism: the bodies
            apply_ac(b, model, par, self.tp),     # activation memory and recomputation
            apply_dp(b, par, layout, dp_group),   # DDP / ZeRO-1/2 gradient buckets
            apply_expert_dp(b, job, rank, layout),  # MoE experts' buckets over expert-DP
            apply_fsdp(b, par, layout, grid),     # ZeRO-3 / FSDP (HSDP) gathers and reductions
            self.pp,                              # pipeline p2p and tied embeddings
        ]
        self.passes: list[Pass] = [p for p in candidates if p is not None]
        # the hooks a pass overrides (the rest do nothing), in the order ``run`` calls them
        self._before = [p.before for p in reversed(self.passes) if type(p).before is not Pass.before]
        self._after = [p.after for p in self.passes if type(p).after is not Pass.after]
        self._ctxs: dict[tuple[str, int, int], Ctx] = {}
        self.actions = ActionStamper(b, self.passes, par.num_microbatches)
        """Whole actions of the chunks whose units are all layers, recorded and stamped."""
        self.layer_chunks = {c for c, layers in enumerate(layout.chunk_layers)
                             if layers and all(u.kind == LAYER for u in self.units(Ctx(), c))}

    # -- setup -----------------------------------------------------------------------
    def setup(self) -> None:
        par = self.job.parallel
        states = model_state_bytes(stage_params(self.job, self.stage), par.shard_degree,
                                   par.zero_stage, self.job.model.dtype, par.optimizer_dtype)
        experts = expert_state_delta(self.job, self.stage, model_state_bytes)  # 0 if dense
        ctx = Ctx("setup")
        for cat in ("params", "grads", "optimizer"):
            self.b.alloc(ctx, f"model.{cat}", cat, getattr(states, cat) + experts[cat])

    # -- the units of a chunk ---------------------------------------------------------
    def units(self, ctx: Ctx, chunk: int) -> Iterator[Unit]:
        """The chunk's units in execution order: embedding (chunk 0), layers, head (last
        chunk) forward; the reverse backward."""
        seq = [(EMBED, ROOT)] if chunk == 0 else []
        seq += [(LAYER, layer) for layer in self.layout.chunk_layers[chunk]]
        if self.layout.is_last_chunk(chunk):
            seq.append((HEAD_UNIT, HEAD))
        if ctx.phase == "bwd":
            seq.reverse()
        for i, (kind, key) in enumerate(seq):
            after = seq[i + 1] if i + 1 < len(seq) else None
            yield Unit(kind, key, ctx.at(layer=key) if kind == LAYER else ctx,
                       next_layer=after[1] if after and after[0] == LAYER else None)

    def run(self, unit: Unit, after: bool = True) -> Idx:
        """The unit's body with every pass's hooks around it (outermost first before it);
        ``after=False`` leaves the after-hooks to the W action of a split backward."""
        for hook in self._before:
            hook(unit)
        unit.out = self.tp.run(unit)
        if after:
            for hook in self._after:
                hook(unit)
        return unit.out

    def ctx_of(self, action: Action) -> Ctx:
        key = ("fwd" if action.phase == "F" else "bwd", action.mb, action.chunk)
        ctx = self._ctxs.get(key)  # receive, compute and send label their ops alike
        if ctx is None:
            ctx = self._ctxs[key] = Ctx.of(key[0], action.mb, action.chunk)
        return ctx

    def receive(self, action: Action) -> Idx:
        """Post the recv of ``action``'s input (None where its chunk has none)."""
        return self.pp.receive(self.ctx_of(action), action.chunk)

    def compute(self, action: Action, x: Idx) -> Idx:
        """``action``'s units on input ``x``; returns its output. A whole forward or backward
        of a chunk of layers is stamped where its kind allows (twin/schedule/actions.py)."""
        if action.phase in ("F", "B") and action.chunk in self.layer_chunks:
            return self.actions(action.phase, action.mb, action.chunk, x,
                                lambda: self._compute(action, x))
        return self._compute(action, x)

    def _compute(self, action: Action, x: Idx) -> Idx:
        ctx = self.ctx_of(action)
        held = []
        for unit in self.units(ctx, action.chunk):
            # a backward's head unit starts from the loss, the op before it
            unit.x = self.b.last_compute if action.phase in ("B", "I") and unit.kind == HEAD_UNIT \
                else x
            if action.phase == "I":  # the weight-gradient ops and the after-hooks wait for W
                self.tp.deferred = []
                x = self.run(unit, after=False)
                held.append((unit, self.tp.deferred))
                self.tp.deferred = None
            else:
                x = self.run(unit)
        if action.phase == "I":
            self.held[(action.mb, action.chunk)] = held
        return x

    def weights(self, action: Action) -> None:
        """W: the weight-gradient ops its I held back, unit by unit in backward order, each
        unit followed by its after-hooks (DDP/ZeRO buckets, activation frees): gradient
        synchronisation follows the W ops (torch's stage_backward_weight)."""
        for unit, ops in self.held.pop((action.mb, action.chunk)):
            from_i = list(unit.grads)  # the norms' weight gradients, made by the I ops
            for grads, local, emit in ops:
                unit.out = grads[local] = emit()
            if ops:  # the weight pass yields every parameter gradient of the unit
                unit.grads.update(dict.fromkeys(from_i, unit.out))
            for p in self.passes:
                p.after(unit)

    def act(self, action: Action) -> None:
        """Receive, compute, send: one action with its own p2p (GPipe, 1F1B: Megatron's
        send_forward_recv_backward and send_backward_recv_forward fall together as one batch)."""
        out = self.compute(action, self.receive(action))
        self.pp.send(self.ctx_of(action), action.chunk, out)

    def lowered(self, items: list[tuple[str, Action]]) -> None:
        """A split-backward or CSV table with its recvs posted where torch's runtime posts
        them (zerobubble.post_recvs); each action then computes and sends at once (an
        overlapped F&B pair: F, its send in flight during B, B, its send)."""
        inputs: dict[tuple[str, int, int], Idx] = {}
        for kind, a in items:
            k = (a.phase == "F", a.mb, a.chunk)
            if kind == "recv":
                inputs[k] = self.receive(a)
            elif a.phase == "W":  # no p2p: nobody waits for a weight gradient but the optimizer
                self.weights(a)
            else:
                self.pp.send(self.ctx_of(a), a.chunk, self.compute(a, inputs.pop(k, None)))

    def megatron_interleaved(self, actions: list[Action]) -> None:
        """Megatron's interleaved exchange: its steps are the warm-up forwards, then (F, B)
        pairs, then the cool-down backwards, and after each step one batch sends the step's
        outputs and receives the next step's inputs (send_forward_recv_forward;
        send_forward_backward_recv_forward_backward; send_backward_recv_backward). A batch
        per action instead pairs sends and recvs that lie in different batches on the two
        stages, which deadlocks a host that waits for each batch (p2p_host_sync)."""
        par = self.job.parallel
        warmup = interleaved_warmup(par.pp, par.num_microbatches, self.stage,
                                    par.pp_virtual_stages)
        steps: list[list[Action]] = []
        forwards = 0
        for a in actions:  # a steady-state forward (past the warm-up) pairs with the backward
            forwards += a.phase == "F"  # after it
            if a.phase == "B" and forwards > warmup and len(steps[-1]) == 1 \
                    and steps[-1][0].phase == "F":
                steps[-1].append(a)
            else:
                steps.append([a])
        inputs = {a: self.receive(a) for a in steps[0]}
        for k, step in enumerate(steps):
            outs = [(a, self.compute(a, inputs.pop(a))) for a in step]
            for a, out in outs:
                self.pp.send(self.ctx_of(a), a.chunk, out)
            if k + 1 < len(steps):
                inputs.update({a: self.receive(a) for a in steps[k + 1]})

    # -- step end ----------------------------------------------------------------------
    def step_end(self) -> None:
        b, par = self.b, self.job.parallel
        ctx = Ctx("opt")
        waits: list[Idx] = [b.last_compute]
        for p in self.passes:
            waits += p.grads_reduced()
        for p in self.passes:
            waits += p.finalize_grads(ctx, waits)
        # over the whole dp group under HSDP too, as PyTorch's clip_grad_norm_ of the 2-D
        # mesh's DTensor gradients does
        dims = ["tp", "pp"] + (dp_dims(par).split("-") if par.zero_stage >= 1 else [])
        norm_group = self.job.grid.group(self.rank, dims)
        local = optimizer_params(self.job, self.stage)  # (MoE: experts' share over edp)
        # clipping to a global norm: the squares of the local gradients summed (one read),
        # the 4-byte all-reduce, then every gradient scaled (read and write)
        squares = b.elementwise(ctx, "grad_norm", local, waits, tensors=1, flops_per_element=2)
        norm = b.collective(ctx, "grad_norm.ar", "all_reduce", norm_group, "-".join(dims), 4,
                            [squares], stream="comm")
        norm = squares if norm is None else norm
        experts = expert_norm_group(self.job, self.rank)  # MoE: the experts' own norm group
        if experts is not None:
            e_norm = b.collective(ctx, "expert.grad_norm.ar", "all_reduce", experts[0],
                                  experts[1], 4, [norm], stream="comm")
            norm = norm if e_norm is None else e_norm
        norm = b.elementwise(ctx, "clip", local, [norm], tensors=2)
        step = b.optimizer(ctx, "adam", local, [norm] + waits,
                           fused=par.optimizer_kernels == "fused")
        for p in self.passes:
            p.after_optimizer(ctx, step)

    def build(self) -> Program:
        par = self.job.parallel
        self.setup()
        if par.pp_schedule_csv is not None or par.pp_schedule in SPLIT_SCHEDULES:
            self.lowered(post_recvs(job_tables(self.job), self.job.placement)[self.stage])
            self.step_end()
            return self.b.program()
        actions = stage_order(par.pp_schedule, par.pp, par.num_microbatches, self.stage,
                              par.pp_virtual_stages)
        if par.pp_schedule == "interleaved" and par.pp > 1:
            self.megatron_interleaved(actions)
        else:
            for action in actions:
                self.act(action)
        self.step_end()
        return self.b.program()


def build_program(job: Job, rank: int) -> Program:
    """One rank's program for one optimizer step."""
    return StepBuilder(job, rank).build()
