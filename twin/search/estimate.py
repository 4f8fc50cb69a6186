"""The fast estimate of a plan's step time: closed forms over the units' times.

Per pipeline stage s and micro-batch, the forward F_s and backward B_s are its units'
times (``twin.search.units``: layers, the embedding on the first stage, the head and loss
on the last; recomputation inside the backward). Under FSDP a layer runs beside the next
layer's all-gather (and, in backward, its own reduce-scatter) on other streams, its own TP
collectives slowed by the share of their links the others hold (``fsdpwalk.beside``); each chunk's
layers are walked with those transfers (``twin.search.fsdpwalk``). A send/recv between
stages costs c = latency + S / bw (``twin.search.comm``); a stage exchanges k_s = 2v times
per micro-batch on the critical path of the steady state (once less at the ends without
interleaving). With W_s = F_s + B_s + k_s c and v chunks
per stage:

    T_pipe = m * max_s W_s + (sum_s W_s - max_s W_s) / v   (1F1B, GPipe: v = 1;
             Narayanan et al. 2021, §2.2: bubble (p - 1) / v of a micro-batch's time)

and the split-backward schedules' own bubbles (ZB-H1, ZB-V, DualPipeV: ``twin.search.
bubble``, from the weight-gradient part W of the units' backward). A MoE model's layers are
timed per class (``units.layer_classes``: its dispatch and combine all-to-alls over EP, the
ETP collectives, the expert GEMMs on the tokens rank 0 receives); under CP on s/cp tokens
with CP's attention, its ring transfers beside the kernels, and the pipeline's messages and
the gradient reductions over dp x cp.

Then the step's tail: the data-parallel gradient collectives left after the last backward
(DDP/ZeRO buckets issued as gradients become ready overlap that backward, Li et al. 2020
§3.2; ZeRO-2/3 reduce every micro-batch on the comm stream), the tied embedding's
all-reduce, the gradient-norm all-reduce, the step end's compute (``step_end_ops``) and
ZeRO-1/2's parameter all-gather (exposed). With the profile's ``p2p_host_sync`` (Megatron
synchronizes the host after each exchange) the host issues every chunk afresh, and a
split-backward schedule's pipeline is walked as its host waits (``twin.search.syncwalk``);
gradients reduced every micro-batch hold each other schedule's exchanges (``synced_reductions_s``). A unit
takes max(device, host) once the host runs ahead (``CostModel.host_time``).
Routed experts on groups of their own reduce their gradients over the expert-data-parallel
group (``edp``) after the dense buckets on the same stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from twin.cost import CostModel
from twin.metrics import throughput
from twin.schedule.emit import Ctx, ProgramBuilder
from twin.schedule.ir import Op
from twin.schedule.pipeline import SPLIT_SCHEDULES, V_SCHEDULES
from twin.search.bubble import pipeline_s
from twin.search.buckets import calls
from twin.search.comm import CommModel, together_s
from twin.search.fsdpwalk import beside, chunk_s, copy_s, tail_s
from twin.search.syncwalk import synced_pipeline_s, synced_reductions_s
from twin.search.units import Timing, layer_classes, unit_plan_key, unit_timings
from twin.spec import Job
from twin.spec.experts import expert_grid, has_expert_groups
from twin.workload.context import dp_dims
from twin.workload.params import (
    expert_params,
    fsdp_layer_units,
    layer_params,
    stage_params,
    vocab_rows,
)

MIB = 1024 * 1024


@dataclass(frozen=True)
class Estimate:
    """A plan's estimated step and where its time goes (per rank, one step)."""

    step_time_s: float
    pipeline_s: float
    """First forward to last backward (the pipeline's part of the step)."""
    bubble_s: float
    """Pipeline fill and drain beyond m micro-batches of the slowest stage."""
    exposed_comm_s: dict[str, float] = field(default_factory=dict)
    """Per group: communication the estimate puts on the critical path."""
    tokens_per_s: float = 0.0
    mfu: float = 0.0


@dataclass(frozen=True)
class Shape:
    """Per pipeline stage: its layers and its parameters (TP-sharded); one layer's bytes."""

    layers: tuple[int, ...]
    params: tuple[int, ...]
    unit_bytes: float
    experts: tuple[int, ...] = ()
    """Per stage: the routed experts' parameters on groups of their own (reduced over edp;
    part of ``params``), or () when the experts live on the dense groups."""


class Estimator:
    """Estimates step times of jobs of one model on one cluster family under one profile,
    caching what plans share (units' times, collective closed forms)."""

    def __init__(self, cost: CostModel):
        self.cost = cost
        self.comm = CommModel(cost)
        self._units: dict[tuple, dict[str, Timing]] = {}
        self._shapes: dict[tuple, Shape] = {}
        self._classes: dict[tuple, tuple] = {}
        self._per_step: dict[tuple, tuple[float, float]] = {}
        self._step_end: dict[tuple, float] = {}
        self._copies: dict[tuple, float] = {}  # FSDP2's copies (fsdpwalk.copy_s)

    def rates(self, job: Job, step_s: float) -> tuple[float, float]:
        """(tokens/s, MFU) at ``step_s`` (``twin.metrics.throughput``, both ~ 1 / step)."""
        p = job.parallel
        key = (job.model, p.global_batch_size, job.grid.world_size, job.peak_dtype,
               repr(job.cluster.gpu))
        hit = self._per_step.get(key)
        if hit is None:
            tokens, _, mfu = throughput(job, 1.0)
            hit = self._per_step[key] = (tokens, mfu)
        return hit[0] / step_s, hit[1] / step_s

    def step_end_s(self, job: Job, local: int) -> float:
        """The step end's compute on ``local`` parameters (``step_end_ops``)."""
        p = job.parallel
        key = (local, p.optimizer_kernels, p.optimizer_dtype, job.model.dtype,
               repr(job.cluster.gpu))
        hit = self._step_end.get(key)
        if hit is None:
            hit = self._step_end[key] = sum(self.cost.compute_time(op, job.cluster.gpu)
                                            for op in step_end_ops(job, local))
        return hit

    def shape(self, job: Job) -> Shape:
        """Layers and parameters per stage (shared by every plan with this split)."""
        p = job.parallel
        model = job.model
        key = (p.tp, p.pp, p.pp_virtual_stages, p.pp_stage_layers, p.pp_schedule in V_SCHEDULES,
               model, p.ep, p.expert_tp)
        hit = self._shapes.get(key)
        if hit is None:
            e = model.dtype_bytes
            units = fsdp_layer_units(job, 0) if model.moe is not None else \
                [layer_params(model, p.tp).total]
            experts = () if not has_expert_groups(model, p) else tuple(
                sum(map(model.moe.is_moe_layer, job.layers_on_stage(s)))
                * expert_params(model, p.ep, p.expert_tp) for s in range(p.pp))
            hit = self._shapes[key] = Shape(
                layers=tuple(len(job.layers_on_stage(s)) for s in range(p.pp)),
                params=tuple(stage_params(job, s) for s in range(p.pp)),
                unit_bytes=e * sum(units) / max(1, len(units)), experts=experts)
        return hit

    def classes(self, job: Job) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per stage: (representative layer, how many of its layers it stands for)."""
        p, model = job.parallel, job.model
        key = (p.tp, p.sp, p.pp, p.pp_virtual_stages, p.pp_stage_layers, model,
               p.pp_schedule in V_SCHEDULES, p.micro_batch_size, p.ep)
        hit = self._classes.get(key)
        if hit is None:
            rep = layer_classes(job)
            out = []
            for s in range(p.pp):
                counts: dict[int, int] = {}
                for layer in job.layers_on_stage(s):
                    counts[rep[layer]] = counts.get(rep[layer], 0) + 1
                out.append(tuple(counts.items()))
            hit = self._classes[key] = tuple(out)
        return hit

    def units(self, job: Job) -> dict[str, Timing]:
        p = job.parallel
        tp = tuple(self.comm.split(job, k, "tp") for k in ("all_reduce", "all_gather",
                                                          "reduce_scatter")) if p.tp > 1 else ()
        own: tuple = ()  # the expert and CP groups' closed forms (not the whole grid)
        if job.model.moe is not None:  # the experts' groups (with ep = 1 too: the expert
            # grid's etp groups need not be the dense tp groups)
            own = (p.ep, p.expert_tp, self.comm.split(job, "all_to_all", "ep"),
                   *(self.comm.split(job, k, "etp") for k in ("all_gather", "reduce_scatter")))
        if p.cp > 1:
            own += (p.cp, p.cp_method, p.cp_load_balance, self.comm.shift(job, "cp"),
                    *(self.comm.split(job, k, "cp") for k in ("all_gather", "reduce_scatter",
                                                             "all_to_all")))
        key = (job.model, unit_plan_key(p), repr(job.cluster.gpu), tp, own)
        hit = self._units.get(key)
        if hit is None:
            hit = self._units[key] = unit_timings(job, self.cost, self.comm)
        return hit

    def __call__(self, job: Job) -> Estimate:
        return estimate(job, self)


def _stage_times(job: Job, est: Estimator, u: dict[str, Timing], shape: Shape) \
        -> tuple[list, list, list, dict]:
    """Per stage (F_s, B_s, W_s) of one micro-batch (W_s: B_s's weight-gradient GEMMs),
    and the exposed TP part."""
    par, model, comm = job.parallel, job.model, est.comm
    p, v, e = par.pp, par.pp_virtual_stages, model.dtype_bytes
    sync = est.cost.p2p_host_sync and p > 1
    fsdp = par.zero_stage == 3 and par.dp * par.cp > 1
    shard, unit_bytes, classes = _shard_group(par), shape.unit_bytes, est.classes(job)
    reps = sorted({r for stage in classes for r, _ in stage})
    lf = {r: u[f"layer_fwd@{r}"].time_s for r in reps}
    lb = {r: u[f"layer_bwd@{r}"].time_s for r in reps}
    ag = red = r_full = 0.0
    if fsdp:  # each layer's compute, its TP slowed beside the gathers (and reduce-scatters)
        ag_split = comm.split(job, "all_gather", shard)
        ag = comm.collective_s(job, "all_gather", shard, unit_bytes)
        parts = [(ag_split, unit_bytes)] if par.fsdp_reshard_after_forward else []
        reduced = unit_bytes * job.fsdp_reduce_bytes / e  # the gradients at the reduce dtype
        if par.sync_every_microbatch:  # a reduce-scatter's own time, and what it adds to
            # the links' work beside a gather (intra- and inter-node phases overlap: together_s)
            parts.append((comm.split(job, "reduce_scatter", shard), reduced))
            r_full = comm.collective_s(job, "reduce_scatter", shard, reduced)
            if par.dp_replicate > 1:  # HSDP: then the shard all-reduced across replicas
                ar = (comm.split(job, "all_reduce", "dp_replicate"), reduced / par.shard_degree)
                parts.append(ar)
                r_full += comm.collective_s(job, "all_reduce", "dp_replicate", ar[1])
            red = together_s(*parts) - (ag if par.fsdp_reshard_after_forward else 0.0)
        co = copy_s(job, est.cost, unit_bytes, est._copies)  # FSDP2's copy-out per gather, copy-in per
        ci = copy_s(job, est.cost, unit_bytes, est._copies, job.fsdp_reduce_bytes) \
            / (1 if par.sync_every_microbatch else par.num_microbatches)  # reduction
        for r in reps:
            lf[r] = beside(u[f"layer_fwd@{r}"], [(ag_split, unit_bytes)], alone=True) + co
            lb[r] = beside(u[f"layer_bwd@{r}"], parts, alone=True) + ci \
                + (co if par.fsdp_reshard_after_forward else 0.0)
    fs, bs, ws, rs = [], [], [], []  # rs: a split backward's reductions past W (synced)
    for s in range(p):
        n = shape.layers[s]
        f = sum(k * lf[r] for r, k in classes[s])
        b = sum(k * lb[r] for r, k in classes[s])
        if fsdp:  # the stage's chunks walked beside their transfers (twin.search.fsdpwalk);
            # a host that waits at the exchange waits for each reduce-scatter whole
            per_chunk = max(1, round(n / v))
            f = v * chunk_s(per_chunk, f / n, ag, s=est.cost.overlap_slowdown)
            b = v * chunk_s(per_chunk, b / n, ag if par.fsdp_reshard_after_forward else 0.0,
                            r_full if sync else red, sync, est.cost.overlap_slowdown)
        w = sum(k * u[f"layer_bwd@{r}"].w_s for r, k in classes[s])
        if s == job.chunk_stage(0):
            f += u["embed_fwd"].time_s
            b += u["embed_bwd"].time_s
            w += u["embed_bwd"].w_s
        if s == job.head_stage:
            f += u["head_fwd"].time_s
            b += u["head_bwd"].time_s
            w += u["head_bwd"].w_s
        if fsdp:  # the root's (embedding, head) gather and its copies, per micro-batch
            root = shape.params[s] * e - n * unit_bytes
            co = copy_s(job, est.cost, root, est._copies)
            f += comm.collective_s(job, "all_gather", shard, root) + co if root > 0 else 0.0
            b += copy_s(job, est.cost, root, est._copies, job.fsdp_reduce_bytes) \
                / (1 if par.sync_every_microbatch else par.num_microbatches)
        if sync:  # the host issues each chunk after the exchange before it has finished,
            # and waits there for reductions issued beside its backward
            if par.pp_schedule in SPLIT_SCHEDULES:  # W makes the gradients: walked
                rs.append(synced_reductions_s(job, comm, w, n))
            else:
                b += synced_reductions_s(job, comm, b, n)
            f += v * u["layer_fwd"].first_host_s
            b += v * u["layer_bwd"].first_host_s
        fs.append(f)
        bs.append(b)
        ws.append(w)
    exposed = {"tp": sum(k * (u[f"layer_fwd@{r}"].exposed_comm_s
                              + u[f"layer_bwd@{r}"].exposed_comm_s) for r, k in classes[0])}
    return fs, bs, ws, rs, exposed


def _shard_group(par) -> str:
    """The group ZeRO/FSDP shards over: dp (dp x cp under CP), or dp_shard under HSDP."""
    return "dp_shard" if par.dp_replicate > 1 else dp_dims(par)


def _dp_tail(job: Job, est: Estimator, f: float, b: float, params: int, unit: float,
             experts: int = 0, layers: int = 0) -> float:
    """Data-parallel gradient communication of a stage (``params`` its parameters, of which
    ``experts`` reduced over edp; ``unit`` the bytes of one of its ``layers`` layers) left
    after its last backward."""
    par, comm, slow = job.parallel, est.comm, est.cost.overlap_slowdown
    m = par.num_microbatches
    if par.dp * par.cp <= 1 and not experts:
        return 0.0
    e = job.model.dtype_bytes
    group = dp_dims(par)
    if par.zero_stage == 3:
        shard = _shard_group(par)

        def reduce(nbytes: float) -> float:  # HSDP: the shard then all-reduced across replicas
            t = comm.collective_s(job, "reduce_scatter", shard, nbytes)
            if par.dp_replicate > 1:
                t += comm.collective_s(job, "all_reduce", "dp_replicate", nbytes / par.shard_degree)
            return t

        rs_unit = reduce(unit * job.fsdp_reduce_bytes / e)  # at the reduce dtype
        if par.sync_every_microbatch:
            return rs_unit  # the last unit's reduction
        return tail_s(b, reduce(params * job.fsdp_reduce_bytes), rs_unit, slow)
    kind = "all_reduce" if par.zero_stage == 0 else "reduce_scatter"
    cap = par.ddp_bucket_MB * MIB
    whole, last = 0.0, 0.0
    for grp, nbytes in ((group, (params - experts) * e), ("edp", experts * e)):
        if nbytes <= 0 or (grp == "edp" and expert_grid(job.grid, par).edp == 1) \
                or (grp != "edp" and par.dp * par.cp == 1):
            continue
        a, per_byte = comm.affine(job, kind, grp)
        whole += calls(job, layers, nbytes, grp == "edp") * a + nbytes * per_byte
        last = a + min(cap, nbytes) * per_byte  # the expert buckets come after the dense
    if par.sync_every_microbatch:
        return tail_s((m - 1) * (f + b) + b, m * whole, last, slow)
    return tail_s(b, whole, last, slow)


def _tail(job: Job, est: Estimator, fs: list, bs: list, c: float, shape: Shape) \
        -> tuple[float, float]:
    """(data-parallel tail, the rest of the step end) after the pipeline's last backward."""
    par, model, comm = job.parallel, job.model, est.comm
    p, v, e = par.pp, par.pp_virtual_stages, model.dtype_bytes
    dp_tail, offset = 0.0, 0.0
    tails: dict[tuple, float] = {}
    experts = shape.experts or (0,) * p
    for s in range(p):  # a later stage ends its backwards earlier (the drain runs to stage
        # 0; in a V too: chunk 0's backward is the last, on stage 0)
        key = (fs[s], bs[s], shape.params[s], experts[s], shape.layers[s])
        if key not in tails:
            tails[key] = _dp_tail(job, est, fs[s], bs[s], shape.params[s], shape.unit_bytes,
                                  experts[s], shape.layers[s])
        dp_tail = max(dp_tail, tails[key] - offset)
        offset += bs[s] / v + c
    rest = 0.0
    if p > 1 and model.tie_embeddings and job.head_stage != job.chunk_stage(0):
        grid = job.grid
        pairs = [(r, r + grid.rank(pp=p - 1)) for r in range(min(grid.gpus_per_node,
                                                                grid.world_size))
                 if grid.coord(r, "pp") == 0]
        nbytes = vocab_rows(model, par.tp) * model.hidden_size * e / \
            (par.shard_degree if par.zero_stage >= 2 else 1)
        a, b = comm.pair_affine(job, "all_reduce", pairs, "embd")
        rest += a + b * nbytes
    dims = "tp-pp" + ("-" + dp_dims(par) if par.zero_stage >= 1 else "")
    rest += comm.collective_s(job, "all_reduce", dims, 4, role=dims)
    s_max = max(range(p), key=lambda s: shape.params[s])
    params, ex = shape.params[s_max], experts[s_max]
    edp = expert_grid(job.grid, par).edp if ex else 1
    local = -(-(params - ex) // par.shard_degree) + -(-ex // edp) if par.zero_stage >= 1 \
        else params
    rest += est.step_end_s(job, local)
    if par.zero_stage in (1, 2) and par.dp * par.cp > 1:
        for grp, nbytes in ((dp_dims(par), (params - ex) * e), ("edp", ex * e)):
            if nbytes > 0 and (grp != "edp" or edp > 1):
                a, b = comm.affine(job, "all_gather", grp)
                rest += calls(job, shape.layers[s_max], nbytes, grp == "edp") * a + nbytes * b
    return dp_tail, rest


def step_end_ops(job: Job, local: int) -> list[Op]:
    """The step end's compute on ``local`` parameters, as ``StepBuilder.step_end`` emits it:
    the squared gradients summed for the norm, the clip, the optimizer step."""
    b, ctx = ProgramBuilder(job, 0), Ctx("opt")
    squares = b.elementwise(ctx, "grad_norm", local, [], tensors=1, flops_per_element=2)
    clip = b.elementwise(ctx, "clip", local, [squares], tensors=2)
    b.optimizer(ctx, "adam", local, [clip], fused=job.parallel.optimizer_kernels == "fused")
    return b.ops


def estimate(job: Job, est: Estimator) -> Estimate:
    """The estimated step of ``job`` (see the module docstring)."""
    par, model = job.parallel, job.model
    p, v, m = par.pp, par.pp_virtual_stages, par.num_microbatches
    u = est.units(job)
    shape = est.shape(job)
    fs, bs, ws, rs, exposed = _stage_times(job, est, u, shape)
    c = 0.0
    if p > 1:
        nbytes = model.dtype_bytes * par.micro_batch_size * model.seq_len * model.hidden_size \
            / ((par.tp if par.sp else 1) * par.cp)
        links = est.comm.p2p(job)
        c = max(a + b * nbytes for a, b in (links if v > 1 else links[:-1]))
    # a stage exchanges twice per micro-batch and chunk (its input's recv beside the last
    # output's send, both ways); without interleaving the end stages once (they have no
    # input to receive, or no output to send, in one direction)
    # (in a V the end stages too: stage 0's first chunk has no input, its last no output;
    # stage p - 1 turns the V on itself)
    vee = par.pp_schedule in V_SCHEDULES
    hops = [2 * v - (1 if (v == 1 or vee) and s in (0, p - 1) else 0) for s in range(p)]
    w = [f + b + k * c for f, b, k in zip(fs, bs, hops)] if p > 1 else [fs[0] + bs[0]]
    worst = max(range(len(w)), key=w.__getitem__)
    half = hops[worst] * c / 2
    if est.cost.p2p_host_sync and p > 1 and par.pp_schedule in SPLIT_SCHEDULES \
            and par.pp_schedule_csv is None:  # the host waits at each exchange
        pipe = synced_pipeline_s(par.pp_schedule, p, m, fs, bs, ws, c, rs)
    else:
        pipe = pipeline_s(par.pp_schedule, p, v, m, w, fs[worst] + half, bs[worst] + half,
                          ws[worst])
    dp_tail, rest = _tail(job, est, fs, bs, c, shape)
    step = pipe + dp_tail + rest
    tokens_per_s, mfu = est.rates(job, step)
    comm = {"tp": m * exposed["tp"], "dp": dp_tail}
    if p > 1:
        comm["pp"] = max(hops) * c * m
    return Estimate(step_time_s=step, pipeline_s=pipe, bubble_s=pipe - m * w[worst],
                    exposed_comm_s={k: x for k, x in comm.items() if x > 0},
                    tokens_per_s=tokens_per_s, mfu=mfu)
