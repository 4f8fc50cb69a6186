"""FSDP's layers of one pipeline chunk beside their gathers and reduce-scatters, walked.

Per micro-batch a chunk of n layers computes c per layer while the network gathers each
layer's parameters (g; FSDP prefetches one layer ahead: layer k + 1's gather is issued
when layer k starts) and, in backward, reduce-scatters each layer's gradients (r, issued
when the layer's backward ends), one after another on the links (concurrent rings share
their NICs, so their times add). Layer k computes once its gather and layer k - 1 are
done. The chunk's first gather is exposed; when the network is the bottleneck the chunk
takes its transfers' time (n g + c forward), when compute is, n c plus the first gather.
The transfers a chunk leaves running overlap the next chunk's compute but not its
transfers, so a chunk takes at least its links' work; a host that waits at each pipeline
exchange (``p2p_host_sync``) also waits for the chunk's last reduce-scatter.
"""

from __future__ import annotations

from functools import lru_cache

from twin.cost import CostModel
from twin.schedule.emit import Ctx, ProgramBuilder
from twin.schedule.sharded import copy_op
from twin.search.comm import together_s
from twin.search.units import Timing
from twin.sim.overlap import overlapped_end
from twin.spec import Job


@lru_cache(maxsize=1 << 16)  # a search meets the same layers and transfers in many plans
def chunk_s(n: int, c: float, g: float, r: float = 0.0, wait: bool = False,
            s: float = 0.0) -> float:
    """One chunk of ``n`` layers on one micro-batch (module docstring): ``c`` a layer's
    compute, ``g`` its gather (0: parameters kept from the forward), ``r`` its gradients'
    reduce-scatter (0: none this micro-batch); ``wait``: the host waits for the last one;
    ``s``: compute slows so while transfers run (overlap_slowdown: from a layer's start the
    links are busy until the last transfer queued ends)."""
    if n <= 0:
        return 0.0
    link = g  # when the links are free; layer 1's gather first
    ready = g  # when the next layer's parameters are gathered
    done = 0.0  # when the last layer's compute ended
    for k in range(n):
        start = max(done, ready)
        if k + 1 < n and g:  # the next layer's gather, issued as this one starts
            link = max(link, start) + g
            ready = link
        done = overlapped_end(start, c, start, link, s)  # slowed while the links are busy
        if r:  # this layer's gradients, after what the links were given before
            link = max(link, done) + r
    if wait:
        return max(done, link)
    return max(done, n * (g + r))


def copy_s(job: Job, cost: CostModel, nbytes: float, cache: dict,
           out_bytes: int | None = None) -> float:
    """Device time of FSDP2's copy of ``nbytes`` on the compute stream (a gathered unit's
    copy-out, a unit's gradients' copy-in, cast to ``out_bytes`` per element:
    twin.schedule.sharded.copy_op); ``cache``: the caller's, for one cost model."""
    if nbytes <= 0:
        return 0.0
    key = (job.model.dtype, repr(job.cluster.gpu), nbytes, out_bytes)
    hit = cache.get(key)
    if hit is None:
        b = ProgramBuilder(job, 0)
        op = b.ops[copy_op(b, Ctx("fwd"), "copy", nbytes, [], out_bytes)]
        hit = cache[key] = cost.compute_time(op, job.cluster.gpu)
    return hit


def beside(unit: Timing, parts: list, alone: bool = False) -> float:
    """A layer with collectives of other streams running beside it (FSDP's gathers and
    reduce-scatters): the longer of the two, and the unit's own exposed collectives slowed
    by the share of their links' time the others take (two flows share a link's bandwidth);
    ``alone``: the layer's own time with that slowdown, not the others' (a walk times them)."""
    if not parts:
        return unit.time_s
    span = unit.time_s if alone else max(unit.time_s, together_s(*parts, tp=unit))
    own = unit.intra_s + unit.inter_s
    if own <= 0 or span <= 0:
        return span
    busy_intra = min(1.0, sum(s * bi for (_, bi, _), s in parts) / span)
    busy_inter = min(1.0, sum(s * be for (_, _, be), s in parts) / span)
    return span + unit.exposed_comm_s * (unit.intra_s * busy_intra
                                         + unit.inter_s * busy_inter) / own


def tail_s(c: float, busy: float, last: float, s: float = 0.0) -> float:
    """What ``busy`` seconds of transfers that start with ``c`` seconds of compute add after
    it: the compute slowed beside them (overlap_slowdown ``s``), then what is left of them,
    at least ``last`` (the last bucket's, issued as the compute ends)."""
    x = overlapped_end(0.0, c, 0.0, busy, s) - c
    return x + max(last, busy - c - x)
