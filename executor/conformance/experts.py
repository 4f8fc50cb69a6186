"""Expert parallelism around the conformance model's MoE layers: plan checks, groups, sharding,
the experts' gradient sync over their expert-data-parallel group, and clipping.

Applied by ``parallelize`` before DDP (``apply_ep``): each MoE layer keeps its EP rank's
E / ep experts and dispatches over the EP group; DDP then ignores the routed experts (their
replicas are the expert-data-parallel group, not DP), and ``ExpertSync`` reduces them the
way Megatron-Core's DDP reduces its expert buffers: scaled by 1 / dp (each expert's gradient
already sums the tokens of every source in its EP group) and all-reduced over edp in
buckets (reverse registration order, a bucket closed once it holds ``ddp_bucket_MB`` MiB),
each issued, in order, once the last micro-batch has made its gradients final. Groups come
from twin/spec/experts.py's ExpertGrid, created by every rank in one order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from executor.conformance.moe import moe_layers, route_in_blocks, routed_tokens, routing_problems
from executor.conformance.train import MAX_NORM, counted_here
from twin.spec import Job
from twin.spec.experts import expert_grid

MiB = 1024 * 1024


def plan_problems(job: Job) -> list[str]:
    """What the MoE conformance model cannot run, each with its fix ([] for a dense model)."""
    p, m = job.parallel, job.model
    if m.moe is None:
        return []
    problems = []
    for field, value in (("tp", p.tp), ("cp", p.cp), ("pp", p.pp)):
        if value > 1:
            problems.append(f"parallel.{field}={value} with a MoE model: conformance runs experts "
                            f"over ep and dp only (tp = cp = pp = 1); set parallel.{field}=1")
    if p.expert_tp != 1:
        problems.append(f"parallel.etp={p.expert_tp}: conformance's experts are not tensor-split; "
                        "set parallel.etp=1 (or null with tp=1)")
    if p.zero_stage != 0:
        problems.append(f"parallel.zero_stage={p.zero_stage} with a MoE model: conformance reduces "
                        "the dense parameters with DDP; use zero_stage=0")
    return problems + routing_problems(m.moe, m.num_layers, routed_tokens(job))


def _my_group(groups, rank: int):
    """Create every group of more than one rank (the same order on every rank); return this
    rank's (None when it is alone)."""
    mine = None
    for ranks in dict.fromkeys(groups):
        if len(ranks) > 1:
            pg = dist.new_group(list(ranks))
            mine = pg if rank in ranks else mine
    return mine


def expert_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of the routed experts, in registration order."""
    return [(n, q) for n, q in model.named_parameters() if ".experts." in f".{n}"]


def apply_ep(model: nn.Module, job: Job) -> ExpertSync | None:
    """Route by the rank's micro-batch; under ep > 1 shard the experts and return their sync
    (None when ep = 1: the experts are replicated like any dense parameter)."""
    p, rank = job.parallel, dist.get_rank()
    route_in_blocks(model, routed_tokens(job), 1.0 / p.num_microbatches)
    if p.ep == 1:
        return None
    grid = expert_grid(job.grid, p)
    world = range(job.grid.world_size)
    ep_group = _my_group([grid.group(r, "ep") for r in world], rank)
    edp_group = _my_group([grid.group(r, "edp") for r in world], rank)
    for layer in moe_layers(model):
        layer.shard(p.ep, grid.coords(rank)["ep"], ep_group)
    sync = ExpertSync([q for _, q in expert_params(model)], edp_group, ep_group, p.dp,
                      p.num_microbatches, int(p.ddp_bucket_MB * MiB))
    model.expert_sync = sync
    return sync


def expert_sync_of(parts) -> ExpertSync | None:
    """The ExpertSync of a rank's parallelised chunks (inside DDP's ``module``), if any."""
    for _, mod, _ in parts:
        sync = getattr(getattr(mod, "module", mod), "expert_sync", None)
        if sync is not None:
            return sync
    return None


class ExpertSync:
    """The routed experts' gradients: 1 / dp, bucketed all-reduce over edp, their own norm."""

    def __init__(self, params: list[nn.Parameter], edp_group, norm_group, dp: int,
                 microbatches: int, cap_bytes: int):
        self.params, self.group, self.norm_group = params, edp_group, norm_group
        self.dp, self.microbatches = dp, microbatches
        self.ids = {id(q) for q in params}
        self.buckets: list[list[nn.Parameter]] = []
        cur, size = [], 0
        for q in reversed(params):  # DDP's rule: reverse order, closed at >= cap
            cur.append(q)
            size += q.numel() * q.element_size()
            if size >= cap_bytes:
                self.buckets.append(cur)
                cur, size = [], 0
        if cur:
            self.buckets.append(cur)
        self.seen: dict[int, int] = {}
        self.next = 0
        self.pending: list[tuple[object, torch.Tensor, list[nn.Parameter]]] = []
        for q in params:
            q.register_post_accumulate_grad_hook(self._ready)

    def _ready(self, q: nn.Parameter) -> None:
        """A gradient accumulated; on the last micro-batch issue every bucket now complete."""
        self.seen[id(q)] = self.seen.get(id(q), 0) + 1
        while self.next < len(self.buckets) and all(
                self.seen.get(id(x), 0) == self.microbatches for x in self.buckets[self.next]):
            bucket = self.buckets[self.next]
            flat = torch.cat([x.grad.reshape(-1) for x in bucket]).div_(self.dp)
            work = None if self.group is None else \
                dist.all_reduce(flat, group=self.group, async_op=True)
            self.pending.append((work, flat, bucket))
            self.next += 1

    def finish(self) -> None:
        """Wait for the buckets and write the reduced gradients back."""
        if self.next != len(self.buckets):
            raise RuntimeError(f"{len(self.buckets) - self.next} expert gradient buckets never "
                               "became ready")
        for work, flat, bucket in self.pending:
            if work is not None:
                work.wait()
            at = 0
            for x in bucket:
                x.grad.copy_(flat[at:at + x.numel()].view_as(x.grad))
                at += x.numel()
        self.seen, self.next, self.pending = {}, 0, []

    def clip(self, named, coords: dict[str, int], tp_sharded: set[str], dense_group) -> float:
        """Clip every gradient to a global norm of MAX_NORM: the dense squares (a replica
        counted once) all-reduced over ``dense_group``, then the experts' over their norm group
        (step.py's expert.grad_norm.ar), norm = sqrt(dense + experts)."""
        self.finish()
        dense = torch.zeros((), dtype=torch.float32)
        experts = torch.zeros((), dtype=torch.float32)
        grads = []
        for name, q in named:
            if q.grad is None:
                continue
            grads.append(q.grad)
            if id(q) in self.ids:
                experts = experts + q.grad.float().pow(2).sum()
            elif counted_here(name, q.grad, coords, tp_sharded):
                dense = dense + q.grad.float().pow(2).sum()
        if dense_group is not None:
            dist.all_reduce(dense, group=dense_group)
        if self.norm_group is not None:
            dist.all_reduce(experts, group=self.norm_group)
        norm = (dense + experts).sqrt()
        coef = torch.clamp(MAX_NORM / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef)
        return float(norm)
