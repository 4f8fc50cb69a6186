"""Data parallelism: DDP's bucketed gradient all-reduce, ZeRO-1/2's bucketed
reduce-scatter and parameter all-gather, and legacy nn.DataParallel.

DDP (Li et al. 2020, PyTorch DDP, §3.2): parameters go into buckets in reverse
registration order, the first capped at 1 MiB and the rest at ``ddp_bucket_MB`` MiB (a
bucket closes once it reaches its cap); a bucket's all-reduce is issued as soon as its
last gradient is ready, buckets in order, overlapping the rest of backward. With
gradient accumulation DDP syncs only the last micro-batch (``no_sync`` before it);
ZeRO-2 reduce-scatters every micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from twin.schedule.emit import Ctx, Idx, ProgramBuilder

FIRST_BUCKET_BYTES = 1024 * 1024  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES


@dataclass
class Bucket:
    keys: list[tuple[int, str]] = field(default_factory=list)
    numel: int = 0


def assign_buckets(tensors: list[tuple[tuple[int, str], int]], elem_bytes: int,
                   cap_MB: float) -> list[Bucket]:
    """Buckets over ``tensors`` ((key, numel) in registration order), DDP's way."""
    caps = [FIRST_BUCKET_BYTES, int(cap_MB * 1024 * 1024)]
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


class GradSync:
    """Issues bucketed gradient collectives over the DP group as gradients become ready.

    kind: all_reduce (DDP) or reduce_scatter (ZeRO-1/2). ``every_mb``: sync each
    micro-batch (ZeRO-2) rather than only the last (DDP's no_sync, ZeRO-1).
    """

    def __init__(self, b: ProgramBuilder, tensors: list[tuple[tuple[int, str], int]],
                 grad_ops: dict[tuple[int, str], str], kind: str, every_mb: bool,
                 paradigm: str):
        self.b = b
        par = b.job.parallel
        self.group = b.job.grid.group(b.rank, "dp")
        self.kind, self.every_mb, self.paradigm = kind, every_mb, paradigm
        self.last_mb = par.num_microbatches - 1
        self.buckets = assign_buckets(tensors, b.e, par.ddp_bucket_MB)
        self.grad_ops = grad_ops  # (layer, tensor) -> local name of the op producing its grad
        self.ready: dict[int, dict[tuple[int, str], int]] = {}
        self.next: dict[int, int] = {}
        self.issued: list[int] = []

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
            idx = self.b.collective(ctx, f"grad.b{k}.{'ar' if self.kind == 'all_reduce' else 'rs'}",
                                    self.kind, self.group, "dp", bucket.numel * self.b.e,
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
        return [self.b.collective(ctx, f"param.b{k}.ag", "all_gather", self.group, "dp",
                                  bucket.numel * self.b.e, [after], stream="comm")
                for k, bucket in enumerate(self.buckets)]
