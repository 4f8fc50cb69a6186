"""Memory ops as real tensors: alloc makes a buffer of the op's bytes, free drops it; live and peak counted.

Each alloc names its buffer in ``op.tag`` and the matching free names it again. On CPU the
peak is the executor's own count of live bytes (``torch.empty`` maps pages lazily, so the
process's resident size would not show it); on GPU ``torch.cuda.max_memory_allocated``
also counts kernel inputs and communication buffers, and the runner reports both.
Every step starts empty: buffers still live at its end (the model states allocated in
``setup``) are dropped, and the next step's setup allocates them again.
"""

from __future__ import annotations

import torch

from twin.schedule.ir import Op


class MemoryPool:
    """Live tensors of one rank's alloc/free ops, with live and peak byte counts."""

    def __init__(self, device: torch.device):
        self.device = device
        self._live: dict[str, torch.Tensor] = {}
        self.live_bytes = 0
        self.peak_bytes = 0

    def apply(self, op: Op) -> None:
        """Allocate or free the buffer named by ``op.tag``."""
        name = op.tag or op.name
        nbytes = max(0, int(round(op.bytes)))
        if op.kind == "alloc":
            if name in self._live:
                raise RuntimeError(f"{op.name}: buffer {name!r} is already allocated; the "
                                   "schedule allocates it twice without a free")
            self._live[name] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        elif op.kind == "free":
            t = self._live.pop(name, None)
            if t is None:
                raise RuntimeError(f"{op.name}: buffer {name!r} is freed but was never allocated")
            self.live_bytes -= t.numel()
        else:
            raise ValueError(f"{op.name}: {op.kind} is not a memory op")

    def reset(self) -> None:
        """Drop every live buffer and restart the peak (at a step's start)."""
        self._live.clear()
        self.live_bytes = 0
        self.peak_bytes = 0
