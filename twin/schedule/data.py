"""Data parallelism's gradient buckets: DDP's bucketed all-reduce, ZeRO-1/2's bucketed
reduce-scatter and parameter all-gather (legacy nn.DataParallel is schedule/legacy.py).

DDP (Li et al. 2020, PyTorch DDP, §3.2): parameters go into buckets in reverse
registration order (a bucket closes once it reaches its cap); a bucket's all-reduce is
issued as soon as its last gradient is ready, buckets in order, overlapping the rest of
backward. With gradient accumulation DDP syncs only the last micro-batch (``no_sync``
before it); ZeRO-2 reduce-scatters every micro-batch.

Bucket caps in the steady state (torch 2.13, torch/nn/parallel/distributed.py):
``_BucketCapacityConfig.create`` sets ``first_bucket_bytes_cap`` to
``dist._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB) only when ``bucket_cap_mb`` is left at None,
and to ``bucket_cap_mb`` itself when it is given; ``compute_bucket_size_limits`` puts every
parameter in one bucket for the first iteration (``[sys.maxsize]`` when
``find_unused_parameters`` is off), and at the second iteration's forward
``reducer._rebuild_buckets()`` rebuckets them in the order their gradients became ready
with the limits ``[first_bucket_bytes_cap, bucket_bytes_cap]`` (the C++ Reducer's default,
``bucket_size_limits_for_rebuilding`` being empty). The schedule is one steady-state step
of DDP constructed with ``bucket_cap_mb=ddp_bucket_MB`` (what executor/conformance does),
so every DDP bucket, the first included, is capped at ``ddp_bucket_MB`` MiB: a model whose
gradients fit in 25 MiB all-reduces them in one call. ZeRO-1/2 keep a 1 MiB first bucket.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from twin.schedule.emit import Ctx, Idx, ProgramBuilder
from twin.schedule.passes import Pass, Unit
from twin.schedule.stage import Key, StageLayout
from twin.spec import ParallelPlan

FIRST_BUCKET_BYTES = 1024 * 1024  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
MiB = 1024 * 1024  # torch/nn/parallel/distributed.py: _MB_TO_BYTES


@dataclass
class Bucket:
    keys: list[Key] = field(default_factory=list)
    numel: int = 0


def assign_buckets(tensors: list[tuple[Key, int]], elem_bytes: int, cap_MB: float,
                   first_cap_bytes: int | None = None) -> list[Bucket]:
    """Buckets over ``tensors`` ((key, numel) in registration order), DDP's way: in reverse
    order, the first closed at ``first_cap_bytes`` (default: the cap), the rest at
    ``cap_MB`` MiB."""
    cap = int(cap_MB * MiB)
    caps = [cap if first_cap_bytes is None else first_cap_bytes, cap]
    buckets, cur = [], Bucket()
    for key, numel in reversed(tensors):
        cur.keys.append(key)
        cur.numel += numel
        if cur.numel * elem_bytes >= caps[min(len(buckets), 1)]:
            buckets.append(cur)
            cur = Bucket()
    if cur.keys:
        buckets.append(cur)
    return buckets


def apply_dp(out: ProgramBuilder, par: ParallelPlan, layout: StageLayout,
             group: tuple[int, ...]) -> GradSync | None:
    """DDP (zero_stage 0) or ZeRO-1/2 gradient buckets over the DP ``group`` (dp x cp under CP);
    None without DP, under ZeRO-3 (sharded.py) and under legacy DP (which reduces to device 0
    itself)."""
    if par.legacy_dp or par.dp * par.cp <= 1 or par.zero_stage not in (0, 1, 2):
        return None
    ddp = par.zero_stage == 0
    buckets = assign_buckets(layout.tensors, out.e, par.ddp_bucket_MB,
                             None if ddp else FIRST_BUCKET_BYTES)
    return GradSync(out, group, buckets, layout.grad_ops,
                    kind="all_reduce" if ddp else "reduce_scatter",
                    every_mb=par.sync_every_microbatch, last_mb=par.num_microbatches - 1,
                    paradigm="ddp" if ddp else f"zero{par.zero_stage}",
                    role="dp-cp" if par.cp > 1 else "dp")


class GradSync(Pass):
    """Issues bucketed gradient collectives over the DP group as gradients become ready.

    kind: all_reduce (DDP) or reduce_scatter (ZeRO-1/2). ``every_mb``: sync each
    micro-batch (ZeRO-2) rather than only the last (DDP's no_sync, ZeRO-1). ZeRO-1/2
    all-gather the updated parameter shards after the optimizer step, bucket by bucket.
    """

    def __init__(self, out: ProgramBuilder, group: tuple[int, ...], buckets: list[Bucket],
                 grad_ops: dict[Key, str], *, kind: str, every_mb: bool, last_mb: int,
                 paradigm: str, role: str = "dp", prefix: str = ""):
        self.b = out
        self.role, self.prefix = role, prefix  # a second sync (MoE experts) names its own
        self.group = group
        self.kind, self.every_mb, self.paradigm = kind, every_mb, paradigm
        self.last_mb = last_mb
        self.buckets = buckets
        self.grad_ops = grad_ops  # (layer, tensor) -> local name of the op producing its grad
        self.ready: dict[int, dict[Key, int]] = {}
        self.next: dict[int, int] = {}
        self.issued: list[int] = []

    # -- as a pass -------------------------------------------------------------------
    def after(self, unit: Unit) -> None:
        if unit.backward:
            self.grads_ready(unit.key, unit.grads, unit.ctx.mb)

    def grads_reduced(self) -> list[Idx]:
        return self.finish()

    def action_key(self, mb: int) -> tuple | None:
        """Quiet in a micro-batch that does not sync (its buckets' state: None where it does)."""
        return None if self.every_mb or mb == self.last_mb else ()

    def after_optimizer(self, ctx: Ctx, step: Idx) -> None:
        if self.kind == "reduce_scatter":
            self.gather_params(ctx.at(paradigm=self.paradigm), step)

    # -- the buckets -----------------------------------------------------------------
    def grads_ready(self, layer: int, grads: dict[str, int], mb: int) -> None:
        """Record the grad ops of one unit's backward; issue every bucket now complete."""
        if not (self.every_mb or mb == self.last_mb):
            return
        ready = self.ready.setdefault(mb, {})
        for key, op in self.grad_ops.items():
            if key[0] == layer and op in grads:
                ready[key] = grads[op]
        k = self.next.get(mb, 0)
        while k < len(self.buckets) and all(key in ready for key in self.buckets[k].keys):
            bucket = self.buckets[k]
            ctx = Ctx("bwd", mb=mb, paradigm=self.paradigm)
            idx = self.b.collective(ctx, f"{self.prefix}grad.b{k}."
                                    f"{'ar' if self.kind == 'all_reduce' else 'rs'}",
                                    self.kind, self.group, self.role, bucket.numel * self.b.e,
                                    [ready[key] for key in bucket.keys], stream="comm")
            if idx is not None:
                self.issued.append(idx)
            k += 1
        self.next[mb] = k

    def finish(self) -> list[int]:
        """Check every bucket was issued; return the sync ops the optimizer waits for."""
        for mb in ([self.last_mb] if not self.every_mb else range(self.last_mb + 1)):
            if self.next.get(mb, 0) != len(self.buckets) and len(self.group) > 1:
                raise AssertionError(f"rank {self.b.rank}: {len(self.buckets) - self.next.get(mb, 0)}"
                                     f" gradient buckets never became ready in micro-batch {mb}")
        return self.issued

    def gather_params(self, ctx: Ctx, after: Idx) -> list[Idx]:
        """ZeRO-1/2: all-gather the updated parameter shards, bucket by bucket."""
        return [self.b.collective(ctx, f"{self.prefix}param.b{k}.ag", "all_gather", self.group,
                                  self.role, bucket.numel * self.b.e, [after], stream="comm")
                for k, bucket in enumerate(self.buckets)]
