"""The search space: every legal parallel plan of a model on a cluster, each exactly once.

A plan is legal when ``twin.spec.build_job`` accepts it; it is listed once in its canonical
form, because several spellings build the same job (``canonical``): the pipeline schedule
and virtual stages mean nothing without pipelining, ZeRO shards nothing over dp = 1, FSDP's
reshard flag only exists under ZeRO-3, and the rank order only matters between the axes of
size > 1 (``tp-cp-pp-dp`` and ``pp-cp-tp-dp`` are one grid when pp = 1). The legality rules
are build_job's (tp divides the heads and the MLP width and is compatible with the KV heads;
tp * pp divides the GPUs; pp * v divides the layers; mb * dp divides the global batch; the
interleaved schedule needs m >= pp micro-batches, a multiple of pp); tests/search holds the
enumeration against a brute-force product filtered by build_job itself. Not searched:
uneven pipeline splits (``pp_stage_layers``), nn.DataParallel (``legacy_dp``) and the plan's
other knobs (flash attention, bucket size, grad sync, cp_method, cp_load_balance), which come
from the base plan.

Beyond those, MoE models search ``ep`` (dividing the experts) and ``etp`` (dividing an
expert's width; ep * etp divides the stage's tp * cp * dp, sp with tp > 1 when the experts
have groups of their own, no ZeRO-3 or HSDP then: ``twin.spec.experts``); ``cp`` (the
base plan's cp_method / cp_load_balance: the sequence's chunks divide it, dense models,
no HSDP: ``twin.spec.context``); ZeRO-3 plans ``dp_replicate`` (HSDP, dividing dp, with
dp_shard = dp / dp_replicate). Their default choices keep the space's size sane
(``SearchSpace``): etp in {1, tp}, cp > 1 only at seq_len >= ``LONG_SEQUENCE``,
dp_replicate in {1, dp / gpus per node}.
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

from twin.spec import ClusterSpec, ConfigError, ConfigWarning, ModelSpec, ParallelPlan
from twin.spec.parallel import PP_SCHEDULES, RECOMPUTE, V_SCHEDULES, ZERO_STAGES

AXES = ("tp", "cp", "pp", "dp")
"""The rank grid's axes in the default order (innermost first)."""
SEARCHED = ("tp", "pp", "micro_batch_size", "sp", "zero_stage", "fsdp_reshard_after_forward",
            "pp_schedule", "pp_virtual_stages", "recompute", "rank_order", "ep", "etp", "cp",
            "dp_replicate")
"""The plan fields a search varies (dp follows from the GPUs: dp = GPUs / (tp * pp * cp))."""
LONG_SEQUENCE = 32768
"""Sequence length from which the default space tries context parallelism (cp > 1)."""
MAX_MICRO_BATCH = 16
"""Largest micro-batch the default space tries (larger ones rarely fit or pay)."""


@dataclass(frozen=True)
class SearchSpace:
    """What to search: GPU counts, the global batch, and per searched field its choices
    (None: every legal value)."""

    gpus: tuple[int, ...]
    """GPU counts to plan for (each a cluster of whole nodes, or part of one node)."""
    global_batch_size: int
    """Sequences per optimizer step, the same for every plan (so their times compare)."""
    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    micro_batch_size: tuple[int, ...] | None = None
    """None: every divisor of the batch per DP rank up to ``max_micro_batch_size``."""
    max_micro_batch_size: int = MAX_MICRO_BATCH
    sp: tuple[bool, ...] | None = None
    zero_stage: tuple[int, ...] | None = None
    fsdp_reshard_after_forward: tuple[bool, ...] | None = None
    pp_schedule: tuple[str, ...] | None = None
    pp_virtual_stages: tuple[int, ...] | None = None
    """None: every v >= 2 with pp * v dividing the layers (interleaved only)."""
    recompute: tuple[str, ...] | None = None
    """None: none, selective and full (op, torchtitan's op-level SAC, only when named)."""
    rank_order: tuple[str, ...] | None = None
    """Orders of the grid's axes, innermost first ('tp-cp-pp-dp'); None: every distinct one."""
    ep: tuple[int, ...] | None = None
    """MoE: expert-parallel degrees; None: every legal one (1 for a dense model)."""
    etp: tuple[int, ...] | None = None
    """MoE: expert tensor-parallel degrees; None: 1 and tp (Megatron's default), if legal."""
    cp: tuple[int, ...] | None = None
    """Context-parallel degrees; None: every legal one at seq_len >= LONG_SEQUENCE, else 1."""
    dp_replicate: tuple[int, ...] | None = None
    """HSDP replicas of ZeRO-3 plans; None: 1 and dp / gpus per node (shard groups of as many
    data-parallel ranks as a node has GPUs) when that divides dp and is > 1."""
    gpus_per_node: int = 8
    """The cluster's GPUs per node (the default dp_replicate: dp / gpus_per_node)."""
    base: ParallelPlan = ParallelPlan()
    """Where the fields the search does not vary come from (flash_attention, grad_sync, ...)."""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def cluster_for(cluster: ClusterSpec, gpus: int) -> ClusterSpec:
    """The cluster with ``gpus`` GPUs: whole nodes, or one node holding ``gpus`` devices."""
    if gpus >= cluster.gpus_per_node:
        return dataclasses.replace(cluster, num_nodes=gpus // cluster.gpus_per_node)
    return dataclasses.replace(cluster, num_nodes=1, gpus_per_node=gpus)


def gpu_counts(cluster: ClusterSpec, lo: int, hi: int) -> list[int]:
    """GPU counts in [lo, hi]: powers of two below one node (dividing it), and whole nodes in
    powers of two (1, 2, 4, ... nodes), plus the range's ends when they are whole nodes."""
    gpn = cluster.gpus_per_node
    out = {c for c in (2 ** k for k in range(gpn.bit_length())) if c < gpn and gpn % c == 0}
    out |= {gpn * 2 ** k for k in range(max(hi // gpn, 1).bit_length())}
    out |= {c for c in (lo, hi) if c % gpn == 0}
    return sorted(c for c in out if lo <= c <= hi)


def legal_tp(model: ModelSpec, gpus: int) -> list[int]:
    """tp degrees build_job accepts: divide the heads, the MLP width (and a MoE's shared
    experts' width) and the GPUs, and divide or are divided by the KV heads."""
    kv = model.num_kv_heads
    shared = model.moe.shared_ffn_hidden_size if model.moe is not None else 0
    return [t for t in divisors(model.num_heads) if model.ffn_hidden_size % t == 0
            and (kv % t == 0 or t % kv == 0) and gpus % t == 0 and shared % t == 0]


def legal_cp(model: ModelSpec, base: ParallelPlan, tp: int, rest: int,
             space: SearchSpace) -> list[int]:
    """cp degrees dividing ``rest`` (GPUs / (tp * pp)) that build_job accepts with the base
    plan's cp_method and cp_load_balance (``twin.spec.context``); the default space tries
    cp > 1 only from seq_len >= LONG_SEQUENCE."""
    if space.cp is None and model.seq_len < LONG_SEQUENCE:
        return [1]
    out = []
    for c in divisors(rest):
        if space.cp is not None and c not in space.cp:
            continue
        if c > 1:
            chunks = 2 * c if base.cp_load_balance == "headtail" else c
            if model.moe is not None or not base.flash_attention or model.seq_len % chunks:
                continue
            if base.cp_method == "alltoall" and not _ulysses_ok(model, tp, c):
                continue
        out.append(c)
    return out


def _ulysses_ok(model: ModelSpec, tp: int, cp: int) -> bool:
    kv_tp = model.num_kv_heads // tp if model.num_kv_heads >= tp else 1
    return model.num_heads % (tp * cp) == 0 and (kv_tp % cp == 0 or cp % kv_tp == 0)


def experts(model: ModelSpec, space: SearchSpace, tp: int, stage: int, sp: bool,
            zero: int) -> list[tuple[int, int | None]]:
    """(ep, etp) pairs build_job accepts (``twin.spec.experts``) for ``stage`` = tp * cp * dp
    ranks per pipeline stage; etp None when it is tp (the canonical spelling)."""
    moe = model.moe
    if moe is None:
        return [(1, None)] if space.ep is None or 1 in space.ep else []
    etps = sorted({1, tp}) if space.etp is None else list(space.etp)
    out = []
    for ep in _choices(space, "ep", divisors(moe.num_experts)):
        for etp in etps:
            own = ep > 1 or etp != tp
            if moe.moe_ffn_hidden_size % etp or stage % (ep * etp) \
                    or (own and ((tp > 1 and not sp) or zero == 3)):
                continue
            out.append((ep, None if etp == tp else etp))
    return out


def replicas(space: SearchSpace, dp: int, gpn: int, zero: int, cp: int, ep: int) -> list[int]:
    """HSDP degrees (dp_replicate) of a plan: 1, and under ZeRO-3 those dividing dp (default:
    dp / gpn, shard groups of gpn data-parallel ranks: a node, or with tp * pp > 1 a group of
    tp * pp nodes), never with cp > 1 or ep > 1 (build_job refuses those)."""
    if zero != 3 or cp > 1 or ep > 1 or dp <= 1:
        return [1] if space.dp_replicate is None or 1 in space.dp_replicate else []
    wanted = space.dp_replicate if space.dp_replicate is not None else \
        (1, dp // gpn) if dp % gpn == 0 else (1,)
    return [r for r in dict.fromkeys(wanted) if dp % r == 0]


def canonical_order(order: str, sizes: dict[str, int]) -> str:
    """The spelling of ``order`` every equivalent order shares: the axes of size > 1 keep
    their relative order in the slots such axes take in the default order; the others stay
    where the default order has them ('pp-cp-tp-dp' with pp = 1 is 'tp-cp-pp-dp')."""
    dims = [d.strip() for d in str(order).split("-")]
    if "cp" not in dims:
        dims = ["cp", *dims]
    live = [d for d in dims if sizes.get(d, 1) > 1]
    it = iter(live)
    return "-".join(next(it) if sizes.get(d, 1) > 1 else d for d in AXES)


def orders_for(sizes: dict[str, int], wanted: tuple[str, ...] | None) -> list[str]:
    """The distinct rank orders of a grid: every permutation of its axes of size > 1 (or the
    canonical forms of ``wanted``), default order first."""
    if wanted is not None:
        out = [canonical_order(o, sizes) for o in wanted]
    else:
        live = [d for d in AXES if sizes.get(d, 1) > 1]
        out = [canonical_order("-".join(p), sizes) for p in itertools.permutations(live)]
    return list(dict.fromkeys(out))


def canonical(plan: ParallelPlan) -> ParallelPlan:
    """One spelling per job (see the module docstring); ``plan.dp`` must be resolved."""
    sizes = {"tp": plan.tp, "pp": plan.pp, "dp": plan.dp, "cp": plan.cp}
    kw: dict = {"rank_order": canonical_order(plan.rank_order, sizes)}
    if plan.pp == 1:
        kw.update(pp_schedule="1f1b", pp_virtual_stages=1)
    if plan.dp * plan.cp == 1:  # (CP ranks shard ZeRO states too)
        kw["zero_stage"] = 0
    if plan.etp == plan.tp:
        kw["etp"] = None
    if plan.dp_replicate == 1:
        kw["dp_shard"] = None
    if kw.get("zero_stage", plan.zero_stage) != 3:
        kw["fsdp_reshard_after_forward"] = True
    return _replace(plan, **kw) if any(getattr(plan, k) != v for k, v in kw.items()) else plan


def _replace(plan: ParallelPlan, **kw) -> ParallelPlan:
    """dataclasses.replace without the warnings of legal plans (a 1F1B fill/drain is searched
    like any other plan; the table shows its bubble)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        return dataclasses.replace(plan, **kw)


def _choices(space: SearchSpace, field: str, default) -> list:
    wanted = getattr(space, field)
    return list(default) if wanted is None else [c for c in default if c in wanted]


def _schedules(space: SearchSpace, model: ModelSpec, pp: int, m: int) -> list[tuple[str, int]]:
    """(schedule, v) pairs legal at pp stages and m micro-batches."""
    if pp == 1:
        plain = space.pp_schedule is None or set(space.pp_schedule) - {"interleaved"}
        return [("1f1b", 1)] if plain else []
    out = []
    for sched in _choices(space, "pp_schedule", PP_SCHEDULES):
        if sched in V_SCHEDULES:  # two chunks per rank; DualPipeV needs m >= 2 pp
            if model.num_layers % (2 * pp) == 0 and (sched == "zb_v" or m >= 2 * pp):
                out.append((sched, 2))
            continue
        if sched != "interleaved":
            out.append((sched, 1))
            continue
        if m < pp or m % pp:
            continue
        vs = [v for v in range(2, model.num_layers // pp + 1) if model.num_layers % (pp * v) == 0]
        out += [("interleaved", v) for v in vs
                if space.pp_virtual_stages is None or v in space.pp_virtual_stages]
    return out


def memory_plans(model: ModelSpec, gpus: int, space: SearchSpace) -> Iterator[ParallelPlan]:
    """Every legal canonical plan on ``gpus`` GPUs in the default rank order (the memory
    model does not depend on the order): the outer loop of ``plans``."""
    gbs, base = space.global_batch_size, space.base
    gpn = min(space.gpus_per_node, gpus)
    for tp in legal_tp(model, gpus):
        if space.tp is not None and tp not in space.tp:
            continue
        for pp in divisors(model.num_layers):
            if gpus % (tp * pp) or (space.pp is not None and pp not in space.pp):
                continue
            for cp in legal_cp(model, base, tp, gpus // (tp * pp), space):
                dp = gpus // (tp * pp * cp)
                if gbs % dp:
                    continue
                yield from _plans_of(model, space, gpn, tp, pp, cp, dp)


def _plans_of(model: ModelSpec, space: SearchSpace, gpn: int, tp: int, pp: int, cp: int,
              dp: int) -> Iterator[ParallelPlan]:
    gbs, base = space.global_batch_size, space.base
    per_dp = gbs // dp
    mbs = [b for b in divisors(per_dp) if b <= space.max_micro_batch_size] \
        if space.micro_batch_size is None else \
        [b for b in space.micro_batch_size if per_dp % b == 0]
    sps = _choices(space, "sp", (False, True)) if tp > 1 else \
        [False] if space.sp is None or False in space.sp else []
    zeros = _choices(space, "zero_stage", ZERO_STAGES) if dp * cp > 1 else [0]
    # op-level SAC when asked for (not by default), where it is modelled: cp = 1, dense
    recomputes = [r for r in _choices(space, "recompute", RECOMPUTE if space.recompute
                                      else tuple(r for r in RECOMPUTE if r != "op"))
                  if r != "op" or (cp == 1 and model.moe is None)]
    for mb in mbs:
        for sched, v in _schedules(space, model, pp, per_dp // mb):
            for sp, zero, rec in itertools.product(sps, zeros, recomputes):
                if zero == 3 and sched in ("zb_h1",) + V_SCHEDULES:
                    continue  # ZeRO-3 with a split backward is not modelled
                if rec == "op" and sp and base.async_tp:
                    continue  # op-level SAC is modelled with TP's own collectives
                reshards = _choices(space, "fsdp_reshard_after_forward", (True, False)) \
                    if zero == 3 else [True]
                for (ep, etp), reshard in itertools.product(
                        experts(model, space, tp, tp * cp * dp, sp, zero), reshards):
                    for r in replicas(space, dp, gpn, zero, cp, ep):
                        yield _replace(
                            base, dp=dp, tp=tp, pp=pp, cp=cp, sp=sp, zero_stage=zero,
                            fsdp_reshard_after_forward=reshard, micro_batch_size=mb,
                            global_batch_size=gbs, pp_schedule=sched, pp_virtual_stages=v,
                            recompute=rec, pp_stage_layers=None, legacy_dp=False,
                            rank_order="tp-cp-pp-dp", ep=ep, etp=etp, dp_replicate=r,
                            dp_shard=dp // r if r > 1 else None)


def plans(model: ModelSpec, gpus: int, space: SearchSpace) -> Iterator[ParallelPlan]:
    """Every legal canonical plan on ``gpus`` GPUs, each rank order of each memory plan."""
    for plan in memory_plans(model, gpus, space):
        for order in orders_for(plan_sizes(plan), space.rank_order):
            yield plan if order == plan.rank_order else _replace(plan, rank_order=order)


def plan_sizes(plan: ParallelPlan) -> dict[str, int]:
    return {"tp": plan.tp, "pp": plan.pp, "dp": plan.dp, "cp": plan.cp}


def check_space(model: ModelSpec, cluster: ClusterSpec, space: SearchSpace) -> None:
    """ConfigError (one line) when the space cannot hold a plan: no GPU count, a global
    batch no data-parallel degree divides, a dtype the GPU has no peak for."""
    if not space.gpus:
        raise ConfigError("no GPU count to plan for: gpus gives none in its range; set gpus=N "
                          "or gpus=[LO,HI] with whole nodes of "
                          f"cluster.gpus_per_node={cluster.gpus_per_node}, or cluster.num_nodes")
    gbs = space.global_batch_size
    if isinstance(gbs, bool) or not isinstance(gbs, int) or gbs < 1:
        raise ConfigError(f"global_batch_size={gbs!r} must be a positive whole number of "
                          "sequences per step (e.g. global_batch_size=1024)")
    if model.dtype not in cluster.gpu.peak_tflops:
        raise ConfigError(f"model.dtype={model.dtype} has no entry in cluster.gpu.peak_tflops "
                          f"({', '.join(cluster.gpu.peak_tflops)}); add one or change the dtype")
    dps = sorted({g // (t * p) for g in space.gpus for t in legal_tp(model, g)
                  for p in divisors(model.num_layers) if g % (t * p) == 0})
    if not dps:
        raise ConfigError(f"no tp * pp of model {model.name} divides "
                          f"{'/'.join(map(str, space.gpus))} GPUs (tp must divide "
                          f"model.num_heads={model.num_heads}, pp model.num_layers="
                          f"{model.num_layers}); choose another GPU count (gpus=N)")
    if not any(gbs % dp == 0 for dp in dps):
        small = dps[0]
        lo = max(small, gbs // small * small)
        raise ConfigError(f"global_batch_size={gbs} cannot be split over any data-parallel "
                          f"degree these GPUs allow (dp in {', '.join(map(str, dps[:8]))}"
                          f"{', ...' if len(dps) > 8 else ''}): it must be a multiple of dp; use "
                          f"a multiple of {small} such as {lo} or {lo + small}")
    for field, legal in (("tp", sorted({t for g in space.gpus for t in legal_tp(model, g)})),
                         ("pp", [p for p in divisors(model.num_layers)
                                 if any(g % p == 0 for g in space.gpus)])):
        wanted = getattr(space, field)
        if wanted is not None and not set(wanted) & set(legal):
            raise ConfigError(f"space.{field}={list(wanted)} holds no legal {field} for model "
                              f"{model.name} on {'/'.join(map(str, space.gpus))} GPUs; use "
                              f"some of {', '.join(map(str, legal))}")
