"""What one pipeline stage holds: its chunks' layers, its tensors in registration order, its units.

The plan fields every pass reads, computed once per rank: which chunks (and so which
layers) the stage runs, its parameter tensors in PyTorch's registration order (the
embedding on the stage of chunk 0, the layers, the final norm and head on the stage of the
last chunk, the last stage or, in a V, the first (``Job.placement``); the head's own copy of
a tied embedding when the embedding lives on another stage), the op after
which each tensor's gradient is ready (DDP and ZeRO buckets) and the parameter count of
each FSDP unit (one per layer plus a root holding the embedding and the head).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from twin.spec import Job
from twin.workload.params import embedding_tensors, head_tensors, synced_layer_tensors

ROOT = -1  # tensor key of the embedding, and the FSDP unit of the embedding, final norm and head
HEAD = -2  # tensor key of the final norm and head (in FSDP's root unit)

Key = tuple[int, str]  # (layer or ROOT or HEAD, tensor name)


@dataclass
class StageLayout:
    """One pipeline stage's chunks, tensors and FSDP units."""

    stage: int
    num_chunks: int
    """Model chunks in the whole pipeline (pp * v); ``Job.placement`` says which stage runs each."""
    chunk_layers: list[range]
    """Global layer indices of every chunk (all stages), in pipeline order."""
    tensors: list[tuple[Key, int]] = field(default_factory=list)
    """(key, TP-local numel) of the stage's parameters, in registration order."""
    grad_ops: dict[Key, str] = field(default_factory=dict)
    """key -> local name of the op after which that tensor's gradient is ready."""
    units: dict[int, int] = field(default_factory=dict)
    """FSDP unit (layer or ROOT) -> TP-local parameter count."""

    @property
    def first(self) -> bool:
        return self.stage == 0

    def is_last_chunk(self, chunk: int) -> bool:
        return chunk == self.num_chunks - 1

    def add(self, layer: int, tensors, unit: int) -> None:
        for t in tensors:
            self.tensors.append(((layer, t.name), t.numel))
            self.grad_ops[(layer, t.name)] = t.grad_op
            self.units[unit] = self.units.get(unit, 0) + t.numel


def stage_layout(job: Job, stage: int) -> StageLayout:
    """The layout of pipeline rank ``stage`` of ``job``."""
    model, par = job.model, job.parallel
    starts = [0]
    for n in job.stage_layers:
        starts.append(starts[-1] + n)
    n_chunks = par.num_stages
    layout = StageLayout(stage, n_chunks, [range(starts[c], starts[c + 1]) for c in range(n_chunks)])
    if stage == job.chunk_stage(0):
        layout.add(ROOT, embedding_tensors(model, par.tp), ROOT)
    for layer in job.layers_on_stage(stage):
        layout.add(layer, synced_layer_tensors(model, par, layer), layer)
    if stage == job.head_stage:
        tied_copy = job.head_stage != job.chunk_stage(0) and model.tie_embeddings
        layout.add(HEAD, head_tensors(model, par.tp, holds_copy=tied_copy), ROOT)
    return layout
