"""Pipeline parallelism's ops: activations sent forward and gradients backward between stages.

A chunk's forward receives its input from the stage of the chunk before (not on chunk 0)
and sends its output to the stage of the chunk after (not on the last chunk); its
backward the reverse. The message is one micro-batch's b*s*h activation (s/t of the
sequence under SP), tagged by chunk and micro-batch so each send pairs with one recv.
The order of the chunks' forwards and backwards is the stage's table (pipeline.py). At
step end, with tied embeddings split over the first and last stage, those two stages
all-reduce the embedding's gradient (Megatron's embedding group; sharded over DP from
ZeRO-2 on).
"""

from __future__ import annotations

from twin.schedule.emit import Ctx, Idx, ProgramBuilder
from twin.schedule.passes import Pass
from twin.spec import ModelSpec, ParallelPlan
from twin.workload.params import vocab_rows


def apply_pp(out: ProgramBuilder, model: ModelSpec, par: ParallelPlan, group: tuple[int, ...],
             stage: int, placement: tuple[int, ...]) -> Pipeline:
    """The chunk boundaries of pipeline rank ``stage`` in its PP ``group`` (none at pp=1);
    ``placement``: the pipeline rank of each chunk (``Job.placement``)."""
    return Pipeline(out, model, par, group, stage, placement)


class Pipeline(Pass):
    """Emits the p2p ops at chunk boundaries and the tied-embedding all-reduce."""

    def __init__(self, out: ProgramBuilder, model: ModelSpec, par: ParallelPlan,
                 group: tuple[int, ...], stage: int, placement: tuple[int, ...]):
        self.b = out
        self.group, self.pp = group, par.pp
        self.stage, self.placement = stage, placement
        self.n_chunks = par.num_stages
        sp_div = par.tp if par.sp else 1
        self.p2p_bytes = out.e * par.micro_batch_size * model.seq_len * model.hidden_size / sp_div
        self.tied_pair = None  # the first and last stage, when they share the embedding
        ends = (placement[0], placement[-1])
        if ends[0] != ends[1] and model.tie_embeddings and stage in ends:
            self.tied_pair = tuple(sorted(group[e] for e in ends))
            self.tied_bytes = vocab_rows(model, par.tp) * model.hidden_size * out.e / \
                (par.shard_degree if par.zero_stage >= 2 else 1)

    def receive(self, ctx: Ctx, chunk: int) -> Idx:
        """At a chunk's start: receive its input (forward: the activation of the chunk
        before; backward: the gradient of the chunk after), or None where it has none."""
        src = chunk - 1 if ctx.phase == "fwd" else chunk + 1
        if not 0 <= src < self.n_chunks or self.placement[src] == self.stage:
            return None  # no input, or handed over on this rank (the turn of a V)
        what = "act" if ctx.phase == "fwd" else "grad"
        return self.b.recv(ctx, "recv", self.group[self.placement[src]],
                           f"{what}.c{src}.mb{ctx.mb}", self.p2p_bytes, [self.b.last_compute],
                           paradigm="pp")

    def send(self, ctx: Ctx, chunk: int, out: Idx) -> None:
        """At a chunk's end: send its output to the next chunk's stage in this direction."""
        dst = chunk + 1 if ctx.phase == "fwd" else chunk - 1
        if not 0 <= dst < self.n_chunks or self.placement[dst] == self.stage:
            return
        what = "act" if ctx.phase == "fwd" else "grad"
        self.b.send(ctx, "send", self.group[self.placement[dst]],
                    f"{what}.c{chunk}.mb{ctx.mb}", self.p2p_bytes, [out], paradigm="pp")

    def action_key(self, mb: int) -> tuple:
        """No hooks inside an action: its p2p lies around it."""
        return ()

    def finalize_grads(self, ctx: Ctx, waits: list[Idx]) -> list[Idx]:
        """Tied embeddings over PP: the first and last stage all-reduce the embedding's grad."""
        if self.tied_pair is None:
            return []
        return [self.b.collective(ctx.at(paradigm="pp"), "embd.ar", "all_reduce", self.tied_pair,
                                  "embd", self.tied_bytes, waits)]
