"""Job: a model, a cluster and a plan checked against each other, with dp and batch resolved."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

from twin.spec.cluster import ClusterSpec
from twin.spec.context import context_problems
from twin.spec.errors import ConfigError, raise_if
from twin.spec.experts import expert_problems
from twin.spec.grid import RankGrid
from twin.spec.model import DTYPE_BYTES, ModelSpec, _divisors
from twin.spec.parallel import ParallelPlan

FLOAT8_PEAK = {"tensorwise": "fp8", "rowwise": "fp8", "mxfp8": "mxfp8"}
"""parallel.float8 -> the dtype of its GEMMs (a cluster.gpu.peak_tflops key)."""


@dataclass(frozen=True)
class Job:
    """One training step's description: what the planner, the twin and the executor read."""

    model: ModelSpec
    cluster: ClusterSpec
    parallel: ParallelPlan
    """With dp and global_batch_size resolved."""

    @cached_property
    def grid(self) -> RankGrid:
        """The rank grid (the only place groups are computed)."""
        p = self.parallel
        return RankGrid.build(dp=p.dp, tp=p.tp, pp=p.pp, cp=p.cp, order=p.rank_dims,
                              gpus_per_node=self.cluster.gpus_per_node,
                              dp_shard=p.shard_degree if p.dp_replicate > 1 else None)

    @property
    def peak_dtype(self) -> str:
        """The dtype whose peak MFU is taken against: the FP8 GEMMs' under parallel.float8,
        else the model's."""
        return FLOAT8_PEAK.get(self.parallel.float8) or self.model.dtype

    @property
    def fsdp_reduce_bytes(self) -> int:
        """Bytes per gradient element ZeRO-3/FSDP reduces (parallel.fsdp_reduce_dtype)."""
        return DTYPE_BYTES[self.parallel.fsdp_reduce_dtype]

    @cached_property
    def stage_layers(self) -> tuple[int, ...]:
        """Layers in each of the pp * v model chunks, in pipeline order."""
        p, n = self.parallel, self.parallel.num_stages
        if p.pp_stage_layers is not None:
            return tuple(p.pp_stage_layers)
        return (self.model.num_layers // n,) * n

    @cached_property
    def placement(self) -> tuple[int, ...]:
        """Pipeline rank of each model chunk: Megatron's c % pp, the V of zb_v and dualpipev
        (twin.schedule.pipeline.chunk_stage), or where the pp_schedule_csv table runs it."""
        from twin.schedule.pipeline import chunk_stage, placement_style

        p = self.parallel
        if p.pp_schedule_csv is not None:
            from twin.schedule.torchcsv import load_table

            return load_table(p.pp_schedule_csv, p.pp, p.num_stages).placement
        style = placement_style(p.pp_schedule)
        return tuple(chunk_stage(c, p.pp, style) for c in range(p.num_stages))

    def chunk_stage(self, chunk: int) -> int:
        """Pipeline rank that holds model chunk ``chunk`` (see ``placement``)."""
        return self.placement[chunk]

    @property
    def head_stage(self) -> int:
        """Pipeline rank of the last chunk (final norm, LM head, loss): pp - 1, or 0 in a V."""
        return self.placement[-1]

    def layers_on_stage(self, stage: int) -> tuple[int, ...]:
        """Global layer indices held by pipeline rank ``stage`` (all its chunks)."""
        starts = [0]
        for n in self.stage_layers:
            starts.append(starts[-1] + n)
        out: list[int] = []
        for chunk, holder in enumerate(self.placement):
            if holder == stage:
                out.extend(range(starts[chunk], starts[chunk + 1]))
        return tuple(out)


def build_job(model: ModelSpec, cluster: ClusterSpec, parallel: ParallelPlan) -> Job:
    """Check the three specs against each other; resolve dp and the global batch.

    Raises ConfigError listing every problem, each naming the field, the value and the fix.
    """
    problems: list[str] = []
    p = parallel
    world = cluster.world_size
    where = f"cluster {cluster.name} has {world} GPUs ({cluster.num_nodes} nodes x " \
            f"{cluster.gpus_per_node})"
    dp = p.dp
    # (the degrees besides dp, named as the user set them: cp only when it is set)
    names, rest = ("tp * pp", p.tp * p.pp) if p.cp == 1 else ("tp * pp * cp", p.tp * p.pp * p.cp)
    vals = f"{p.tp} * {p.pp}" + (f" * {p.cp}" if p.cp > 1 else "")
    if dp is None:
        if world % rest:
            problems.append(f"{names} = {vals} = {rest} does not divide the "
                            f"{world} GPUs of cluster {cluster.name}; choose {names} among "
                            f"{', '.join(map(str, _divisors(world)))}")
        else:
            dp = world // rest
    elif dp * rest != world:
        fill = f"dp={world // rest}" if world % rest == 0 else \
            f"a {names} that divides the GPU count"
        problems.append(f"dp * {names} = {dp} * {vals} = {dp * rest} but {where}; "
                        f"use {fill}, set parallel.dp=null to fill the cluster, or change "
                        "cluster.num_nodes / cluster.gpus_per_node")
    m = model
    tp_ok = [t for t in _divisors(m.num_heads) if m.ffn_hidden_size % t == 0]
    if m.num_heads % p.tp:
        problems.append(f"tp={p.tp} does not divide model.num_heads={m.num_heads}; use one of "
                        f"{', '.join(map(str, tp_ok))}")
    if m.ffn_hidden_size % p.tp:
        problems.append(f"tp={p.tp} does not divide model.ffn_hidden_size={m.ffn_hidden_size}; "
                        f"use one of {', '.join(map(str, tp_ok))}")
    kv = m.num_kv_heads
    if kv % p.tp and p.tp % kv:
        ok = [t for t in tp_ok if kv % t == 0 or t % kv == 0]
        problems.append(f"tp={p.tp} and model.num_kv_heads={kv}: one must divide the other so "
                        f"KV heads split evenly (tp <= kv) or replicate evenly (tp > kv); use tp "
                        f"in {', '.join(map(str, ok))}")
    n_chunks = p.num_stages
    if p.pp_stage_layers is not None:
        if sum(p.pp_stage_layers) != m.num_layers:
            problems.append(f"parallel.pp_stage_layers sums to {sum(p.pp_stage_layers)} but "
                            f"model.num_layers={m.num_layers}; make the counts add up")
    elif m.num_layers % n_chunks:
        what = "pp" if p.pp_virtual_stages == 1 else \
            f"pp * pp_virtual_stages = {p.pp} * {p.pp_virtual_stages}"
        ok = [d for d in _divisors(m.num_layers) if d % p.pp_virtual_stages == 0] \
            if p.pp_virtual_stages > 1 else _divisors(m.num_layers)
        problems.append(f"{what} = {n_chunks} does not divide model.num_layers={m.num_layers}; "
                        f"use a total of stages in {', '.join(map(str, ok))} or give "
                        "parallel.pp_stage_layers for an uneven split")
    if p.legacy_dp and dp is not None and dp > cluster.gpus_per_node:
        problems.append(f"parallel.legacy_dp=true drives all devices from one process, so dp={dp} "
                        f"must fit on one node of {cluster.gpus_per_node} GPUs; use DDP "
                        "(legacy_dp=false) across nodes")
    problems += expert_problems(m, p, dp)  # MoE: ep, etp and their groups
    if p.recompute == "op" and m.moe is not None:
        problems.append("parallel.recompute=op (op-level SAC) is modelled for dense layers; "
                        f"model {m.name} has MoE layers: use recompute=selective|full")
    problems += context_problems(m, p)  # CP: sequence chunks, Ulysses heads
    peak8 = FLOAT8_PEAK.get(p.float8)
    if peak8 and peak8 not in cluster.gpu.peak_tflops:
        problems.append(f"parallel.float8={p.float8} needs FP8 tensor cores but "
                        f"{cluster.gpu.name} has no {peak8} peak (cluster.gpu.peak_tflops: "
                        f"{', '.join(cluster.gpu.peak_tflops)}); set parallel.float8=none or add "
                        f"cluster.gpu.peak_tflops.{peak8}")
    if peak8 and m.dtype != "bf16":
        problems.append(f"parallel.float8={p.float8} trains in bf16 around its FP8 GEMMs (torchao) "
                        f"but model.dtype={m.dtype}; set model.dtype=bf16")
    if m.dtype not in cluster.gpu.peak_tflops:
        problems.append(f"model.dtype={m.dtype} has no entry in cluster.gpu.peak_tflops "
                        f"({', '.join(cluster.gpu.peak_tflops)}); add one or change the dtype")
    raise_if(problems)
    gbs = p.global_batch_size
    if gbs is None:
        gbs = p.micro_batch_size * dp * (4 * p.pp if p.pp > 1 else 1)
    try:
        resolved = dataclasses.replace(p, dp=dp, global_batch_size=gbs)
        if resolved.dp_replicate > 1:
            resolved = dataclasses.replace(resolved, dp_shard=resolved.shard_degree)
    except ConfigError as err:
        raise ConfigError(err.problems) from None
    job = Job(model=model, cluster=cluster, parallel=resolved)
    if resolved.pp_schedule_csv is not None:  # read and checked once, here: one line if bad
        from twin.schedule.torchcsv import load_table

        table = load_table(resolved.pp_schedule_csv, resolved.pp, resolved.num_stages)
        if table.microbatches != resolved.num_microbatches:
            raise ConfigError(f"parallel.pp_schedule_csv={resolved.pp_schedule_csv} runs "
                              f"{table.microbatches} micro-batches but the plan has "
                              f"{resolved.num_microbatches} (global_batch_size / "
                              "(micro_batch_size * dp)); set parallel.global_batch_size="
                              f"{table.microbatches * resolved.micro_batch_size * dp}")
    return job
