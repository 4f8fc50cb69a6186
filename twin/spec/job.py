"""Job: a model, a cluster and a plan checked against each other, with dp and batch resolved."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

from twin.spec.cluster import ClusterSpec
from twin.spec.errors import ConfigError, raise_if
from twin.spec.grid import RankGrid
from twin.spec.model import ModelSpec, _divisors
from twin.spec.parallel import ParallelPlan


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
                              gpus_per_node=self.cluster.gpus_per_node)

    @cached_property
    def stage_layers(self) -> tuple[int, ...]:
        """Layers in each of the pp * v model chunks, in pipeline order."""
        p, n = self.parallel, self.parallel.num_stages
        if p.pp_stage_layers is not None:
            return tuple(p.pp_stage_layers)
        return (self.model.num_layers // n,) * n

    def chunk_stage(self, chunk: int) -> int:
        """Pipeline rank that holds model chunk ``chunk`` (Megatron: chunk c on stage c % pp)."""
        return chunk % self.parallel.pp

    def layers_on_stage(self, stage: int) -> tuple[int, ...]:
        """Global layer indices held by pipeline rank ``stage`` (all its chunks)."""
        starts = [0]
        for n in self.stage_layers:
            starts.append(starts[-1] + n)
        out: list[int] = []
        for chunk in range(stage, self.parallel.num_stages, self.parallel.pp):
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
    if dp is None:
        if world % (p.tp * p.pp * p.cp):
            problems.append(f"tp * pp = {p.tp} * {p.pp} = {p.tp * p.pp} does not divide the "
                            f"{world} GPUs of cluster {cluster.name}; choose tp * pp among "
                            f"{', '.join(map(str, _divisors(world)))}")
        else:
            dp = world // (p.tp * p.pp * p.cp)
    elif dp * p.tp * p.pp * p.cp != world:
        fill = f"dp={world // (p.tp * p.pp)}" if world % (p.tp * p.pp) == 0 else \
            "a tp * pp that divides the GPU count"
        problems.append(f"dp * tp * pp = {dp} * {p.tp} * {p.pp} = {dp * p.tp * p.pp} but {where}; "
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
    if m.dtype not in cluster.gpu.peak_tflops:
        problems.append(f"model.dtype={m.dtype} has no entry in cluster.gpu.peak_tflops "
                        f"({', '.join(cluster.gpu.peak_tflops)}); add one or change the dtype")
    raise_if(problems)
    gbs = p.global_batch_size
    if gbs is None:
        gbs = p.micro_batch_size * dp * (4 * p.pp if p.pp > 1 else 1)
    try:
        resolved = dataclasses.replace(p, dp=dp, global_batch_size=gbs)
    except ConfigError as err:
        raise ConfigError(err.problems) from None
    return Job(model=model, cluster=cluster, parallel=resolved)
