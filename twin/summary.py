"""Summary: the figures of one run (summary.json), typed, with the same flat keys on both sides.

``twin.metrics.summarize`` computes the metric fields from a trace; the twin adds its run's
fields (simulated ranks, fold, events, wall time, profile, ...) and the executor its own
(backend, device, measured memory, startup, ...) into ``extra``. ``to_dict`` gives the flat
JSON object users script against (``format=json``); the summary also reads like that dict
(``summary["step_time_s"]``), so readers of summary.json and of a Summary are the same code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

TWIN_FIELDS = ("source", "simulated_ranks", "fold", "events", "wall_s", "events_per_s", "ops",
               "profile", "jitter", "seed", "critical_path_s", "critical_path_shape_factors_s",
               "fast_forward", "trace", "notes")
"""What the twin adds (``twin.sim.run.simulate``)."""
EXECUTOR_FIELDS = ("source", "backend", "device", "steps_planned", "warmup", "verify",
                   "measured_peak_memory_bytes", "measured_peak_memory_max_bytes",
                   "measured_memory_source", "workspace_bytes", "startup_s", "clock",
                   "barrier_exit_spread_us", "written_at")
"""What the executor adds (``executor.runner``)."""


@dataclass
class Summary(Mapping):
    """One run's figures: the median step and its spread, throughput, MFU, where time goes."""

    step_time_s: float
    """Median step time."""
    step_time_p10_s: float
    step_time_p50_s: float
    step_time_p90_s: float
    steps: int
    tokens_per_s: float
    tflops_per_gpu: float
    """Model FLOPs per second per GPU (TFLOP/s)."""
    mfu: float
    """Model FLOPs utilisation: model FLOPs per second over the GPUs' peak (PaLM, App. B)."""
    bubble_fraction: float
    exposed_comm_s: dict[str, float]
    """Per group: communication not hidden behind compute, mean over ranks."""
    compute_s: dict[str, float]
    """Per rank (as a string): compute time in the median step."""
    idle_s: dict[str, float]
    peak_memory_bytes: dict[str, float]
    peak_memory_max_bytes: float
    fits_memory: bool
    world_size: int
    model_flops_per_step: float
    tokens_per_step: float
    mfu_peak_dtype: str = ""
    """Whose peak ``mfu`` divides by: the model dtype's, or fp8 / mxfp8 under parallel.float8
    ("" in summaries written before this field)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """The source's own fields (TWIN_FIELDS, EXECUTOR_FIELDS, out_dir), flat in to_dict()."""

    def to_dict(self) -> dict[str, Any]:
        """The summary.json object: every field, then the extra ones, flat."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        out.update(self.extra)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Summary:
        """A Summary of a summary.json object (unknown keys go to ``extra``)."""
        fields = [f for f in dataclasses.fields(cls) if f.name != "extra"]
        names = {f.name for f in fields}
        required = {f.name for f in fields if f.default is dataclasses.MISSING}
        missing = sorted(required - set(data))
        if missing:
            raise ValueError(f"not a paratwin summary: missing {', '.join(missing)}")
        return cls(**{k: data[k] for k in names if k in data}, extra={k: v for k, v in data.items()
                                                          if k not in names})

    def __getitem__(self, key: str) -> Any:
        if key != "extra" and key in self.__dataclass_fields__:
            return getattr(self, key)
        return self.extra[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_dict())

    def __len__(self) -> int:
        return len(self.__dataclass_fields__) - 1 + len(self.extra)
