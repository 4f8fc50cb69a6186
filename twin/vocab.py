"""The shared vocabulary: op kinds, streams, phases, memory categories and byte conventions.

One place for the words both sides use (the schedule IR, the twin, the executor, the
reports, calibration), so that a kind added here is known everywhere and a string
typed twice cannot drift.
"""

from __future__ import annotations

COMPUTE_KINDS = ("gemm", "attention", "elementwise", "optimizer")
"""Kernels: GEMM (m, n, k), attention (b, heads, s, d), memory-bound elementwise, optimizer step."""
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce",
                    "gather", "scatter", "all_to_all")
P2P_KINDS = ("send", "recv")
MEMORY_KINDS = ("alloc", "free")
"""Memory ops: zero-length spans whose bytes and category say what was allocated or freed."""
KINDS = COMPUTE_KINDS + COLLECTIVE_KINDS + P2P_KINDS + MEMORY_KINDS

PHASES = ("fwd", "bwd", "recompute", "opt", "setup")
PIPELINE_PHASES = ("fwd", "bwd", "recompute")
"""Phases inside a pipeline's forward/backward window (bubbles are measured there)."""
MEMORY_CATEGORIES = ("params", "grads", "optimizer", "activations", "buffers")

GIB = float(2 ** 30)
"""Bytes in a GiB (memory figures and counters)."""

BENCH_ONLY_KINDS = ("sendrecv",)
"""Measured by ``paratwin bench`` but not an IR kind: one message from rank 0 to rank 1."""


# Byte conventions, nccl-tests doc/PERFORMANCE.md: an op's ``bytes`` is the buffer size S
# (all-reduce, broadcast: the buffer; all-gather: the gathered output; reduce-scatter: the
# full input), algbw = S / t, busbw = algbw * busbw_factor.
def busbw_factor(kind: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor of ``kind`` over ``n`` ranks (gather/scatter as in
    its gather.cu/scatter.cu; a send/recv pair moves each byte once)."""
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        return (n - 1) / n
    if kind in ("broadcast", "reduce", "sendrecv", "send", "recv"):
        return 1.0
    raise ValueError(f"no bus-bandwidth factor for {kind!r}")


def wire_factor(kind: str, n: int) -> float:
    """Bytes one rank itself sends per byte of S with ring algorithms: 2(n-1)/n for
    all-reduce, (n-1)/n for all-gather, reduce-scatter and all-to-all, 1 for the rooted
    kinds and send (each rank's share moves once)."""
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if kind in ("broadcast", "reduce", "gather", "scatter", "send"):
        return 1.0
    raise ValueError(f"no wire factor for {kind!r}")
