"""Gradient buckets as the schedule makes them, for the estimate: how many calls a stage's
reduction (and ZeRO's parameter all-gather) takes.

``twin.schedule.data.assign_buckets`` closes a bucket once it reaches its cap, so a tensor
larger than the cap is a bucket of its own: the calls are not bytes / cap. GPT-3 175B's
weight matrices (12288 x 12288 / t) and Mixtral's stacked experts (8 x 4096 x 14336 x 2 per
layer) are tens to hundreds of times the 25 MiB cap; counting bytes / cap charged each stage
thousands of calls' latency (0.4 s on Mixtral 8x7B with etp=1) the twin never pays.
"""

from __future__ import annotations

from functools import lru_cache

from twin.schedule.data import assign_buckets
from twin.workload.params import expert_tensors, layer_tensors


@lru_cache(maxsize=1024)
def bucket_sizes(model, tp: int, layers: int, e: int, cap_MB: float) -> tuple[int, ...]:
    """Elements per gradient bucket of ``layers`` dense layers, in the order they are issued."""
    tensors = [((i, t.name), t.numel) for i in range(layers) for t in layer_tensors(model, tp)]
    return tuple(b.numel for b in assign_buckets(tensors, e, cap_MB))


@lru_cache(maxsize=1024)
def _expert_buckets(model, ep: int, etp: int, layers: int, e: int, cap_MB: float) -> int:
    tensors = [((i, t.name), t.numel) for i in range(layers) for t in expert_tensors(model, ep, etp)]
    return len(assign_buckets(tensors, e, cap_MB))


def calls(job, layers: int, nbytes: float, experts: bool = False) -> int:
    """Bucketed calls reducing ``nbytes`` of a stage's gradients: its ``layers`` layers' dense
    tensors, plus one for the rest (embedding, head, final norm); with ``experts``, the routed
    experts' (``nbytes`` of them: as many MoE layers as that holds)."""
    par, e = job.parallel, job.model.dtype_bytes
    if nbytes <= 0:
        return 0
    if experts:
        per_layer = sum(t.numel for t in expert_tensors(job.model, par.ep, par.expert_tp)) * e
        n = max(1, round(nbytes / per_layer))
        return _expert_buckets(job.model, par.ep, par.expert_tp, n, e, par.ddp_bucket_MB)
    dense = bucket_sizes(job.model, par.tp, layers, e, par.ddp_bucket_MB) if layers else ()
    rest = nbytes - sum(dense) * e
    return len(dense) + (1 if rest > 0 else 0)
