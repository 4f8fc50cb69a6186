"""Async tensor parallelism: each SP all-gather -> GEMM and GEMM -> reduce-scatter pair as tp
chunked steps whose partial GEMMs overlap the transfers (PyTorch's micro-pipeline TP, which
torchtitan turns on with ``enable_async_tensor_parallel``; Wang et al. 2022, "Overlap
communication with dependent computation via decomposition").

All-gather -> GEMM (``_pipelined_all_gather_and_consume``): every rank copies its chunk of
the sequence to each peer (tp - 1 copies of b*s*h/tp bytes, straight from its owner through
symmetric memory) while it multiplies its own chunk; then each received chunk in turn: tp
partial GEMMs of b*s/tp rows. GEMM -> reduce-scatter (``_pipelined_produce_and_all2all``):
step s multiplies the rows of the chunk a peer owns and copies that partial product to it
while the next step multiplies; the rank's own chunk comes last, and one kernel sums its
partial with the tp - 1 received. The same wire bytes as the ring all-gather and
reduce-scatter: (tp - 1)/tp of the activation per rank. The partial GEMMs have tp times
fewer rows, so the cost model's tile and wave quantization prices them at their own (lower)
efficiency. Under FP8 each partial GEMM casts its rows of the activation, and the first casts
the weight for all of them; with torchao's Float8 TP styles (twin.workload.params.fp8_tp_gather)
the gathered chunks move in FP8, each cast once by its owner, and the partial GEMMs cast
their weights only. The copies are TP-group send/recv (``group_name`` tp, on copy engines: no
host sync).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from twin.schedule.emit import Ctx, Idx, ProgramBuilder


class GemmSpec(NamedTuple):
    """One GEMM of a pair: its local name, output columns and inner dimension; ``chained``
    GEMMs also wait for the GEMM before them (accumulating into the same output)."""

    name: str
    n: int
    k: int
    chained: bool = False


class AsyncTP:
    """Emits the chunked steps for one rank of its TP ``group``."""

    def __init__(self, out: ProgramBuilder, group: tuple[int, ...], tokens: int, hidden: int,
                 fp8: bool = False):
        self.b = out
        self.group = group
        self.tp = len(group)
        self.me = group.index(out.rank)
        self.rows = tokens // self.tp  # the rows of one chunk of the sequence
        self.hidden = hidden
        self.chunk_bytes = out.e * self.rows * hidden
        self.fp8 = fp8
        """torchao's Float8 TP styles: the gathered chunks move in FP8, cast once by their
        owner (TensorParallel.fp8_gather)."""

    def _exchange(self, ctx: Ctx, local: str, s: int, x: Idx, nbytes: float = 0.0) -> Idx:
        """Step ``s``'s copy: ``x`` to the rank s + 1 places on in the group, the matching
        chunk from the rank s + 1 places back (symmetric memory: each chunk straight from
        its owner); returns the receive. ``nbytes``: 0 for a chunk in the model dtype."""
        nbytes = nbytes or self.chunk_bytes
        tag = f"{ctx.prefix()}/{local}.s{s}"
        to = self.group[(self.me + s + 1) % self.tp]
        frm = self.group[(self.me - s - 1) % self.tp]
        self.b.send(ctx, f"{local}.send.s{s}", to, tag, nbytes, [x], group_name="tp")
        return self.b.recv(ctx, f"{local}.recv.s{s}", frm, tag, nbytes, [x], group_name="tp")

    def _gemms(self, ctx: Ctx, specs: Sequence[GemmSpec], s: int, deps: list,
               act_cast: bool = True) -> list[Idx]:
        outs: list[Idx] = []
        for spec in specs:
            extra = [outs[-1]] if spec.chained and outs else []
            outs.append(self.b.gemm(ctx, f"{spec.name}.s{s}", self.rows, spec.n, spec.k,
                                    deps + extra, weight_cast=s == 0,  # (FP8: cast once)
                                    act_cast=act_cast))
        return outs

    def gather_gemms(self, ctx: Ctx, local: str, x: Idx,
                     specs: Sequence[GemmSpec]) -> tuple[Idx, list[Idx]]:
        """All-gather ``x`` over TP fused with ``specs``: (the op after which the whole
        gathered input is here, the last partial of each GEMM). Step 0 multiplies the
        rank's own chunk while every copy is under way; step s the chunk received s-th."""
        ctx = ctx.at(paradigm="async_tp")
        nbytes, fp8 = 0.0, self.fp8 and not local.endswith(".bwd")  # (gradients: bf16)
        if fp8:  # the rank's chunk cast to FP8 before it is sent
            x = self.b.fp8_cast(ctx, local, self.rows * self.hidden, 0, [x])
            nbytes = self.chunk_bytes / self.b.e
        chunks = [x] + [self._exchange(ctx, local, s, x, nbytes) for s in range(self.tp - 1)]
        outs: list[Idx] = []
        for s, chunk in enumerate(chunks):
            outs = self._gemms(ctx, specs, s, [chunk], act_cast=not fp8)
        return chunks[-1], outs

    def gemms_scatter(self, ctx: Ctx, local: str, deps: list,
                      specs: Sequence[GemmSpec]) -> Idx:
        """``specs`` fused with the reduce-scatter of their output over TP: step s computes
        the partial product of the chunk that the rank s + 1 places on owns and copies it
        there while step s + 1 computes; the rank's own chunk comes last, and one kernel
        sums it with the tp - 1 received (reads tp chunks, writes one). Returns that sum."""
        ctx = ctx.at(paradigm="async_tp")
        received = []
        part: Idx = None
        for s in range(self.tp):
            part = self._gemms(ctx, specs, s, list(deps))[-1]
            if s < self.tp - 1:
                received.append(self._exchange(ctx, local, s, part))
        return self.b.elementwise(ctx, f"{local}.reduce", self.rows * specs[-1].n,
                                  [part, *received], tensors=self.tp + 1)
