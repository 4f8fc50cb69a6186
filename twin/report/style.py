"""One look for every figure: what colour a span gets, lane order, and number formats."""

from __future__ import annotations

from twin.schedule.ir import COLLECTIVE_KINDS, COMPUTE_KINDS, P2P_KINDS
from twin.trace import Span
from twin.vocab import GIB  # noqa: F401 - the report's unit of memory

PHASE_LABEL = {"fwd": "forward", "bwd": "backward", "recompute": "recompute", "opt": "optimizer",
               "setup": "setup"}
FIXED = {"forward": "#3366CC", "backward": "#FF9900", "recompute": "#DD4477",
         "optimizer": "#109618", "setup": "#7F7F7F", "send": "#8C564B", "recv": "#C7A17A",
         "idle": "#D9D9D9"}
# one hue per collective kind; groups of that kind vary in lightness
HUE = {"all_reduce": 275, "all_gather": 172, "reduce_scatter": 2, "broadcast": 48, "reduce": 320,
       "gather": 28, "scatter": 95, "all_to_all": 200}
GROUP_ORDER = ("tp", "dp", "pp", "cp")
LIGHTNESS = (34, 56, 74, 26)
"""Lightness of a collective's colour for the groups above; other groups (e.g. the
gradient-norm group 'tp-pp-dp') get a shifted hue instead."""
MEMORY_COLORS = {"params": "#4C78A8", "grads": "#F58518", "optimizer": "#54A24B",
                 "activations": "#E45756", "buffers": "#B279A2"}
CATEGORY_ORDER = ("forward", "backward", "recompute", "optimizer", "setup")


def category(s: Span) -> str:
    """The legend entry of a span: phase for compute, kind and group for communication."""
    if s.kind in COMPUTE_KINDS:
        return PHASE_LABEL.get(s.phase, s.phase or s.kind)
    if s.kind in COLLECTIVE_KINDS:
        return f"{s.kind} ({s.group})" if s.group else s.kind
    if s.kind in P2P_KINDS:
        return s.kind
    return s.kind


def color(cat: str) -> str:
    """A fixed colour for a category (same in every figure and every report)."""
    if cat in FIXED:
        return FIXED[cat]
    kind, _, rest = cat.partition(" (")
    if kind in HUE:
        group = rest.rstrip(")")
        if group in GROUP_ORDER:
            return f"hsl({HUE[kind]},62%,{LIGHTNESS[GROUP_ORDER.index(group)]}%)"
        shift = 22 + 14 * (sum(map(ord, group)) % 3) if group else 0
        return f"hsl({(HUE[kind] + shift) % 360},70%,48%)"
    return f"hsl({sum(map(ord, cat)) * 37 % 360},40%,50%)"


def category_key(cat: str) -> tuple:
    """Legend order: compute phases, then collectives by kind, then p2p, then idle."""
    if cat in CATEGORY_ORDER:
        return (0, CATEGORY_ORDER.index(cat), cat)
    kind = cat.partition(" (")[0]
    if kind in HUE:
        return (1, COLLECTIVE_KINDS.index(kind) if kind in COLLECTIVE_KINDS else 99, cat)
    if cat in ("send", "recv"):
        return (2, 0, cat)
    return (3, 0, cat)


def stream_key(stream: str) -> tuple:
    """Lane order inside a rank: compute, comm streams, p2p, anything else."""
    if stream == "compute":
        return (0, stream)
    if stream.startswith("comm"):
        return (1, stream)
    if stream == "p2p":
        return (2, stream)
    return (3, stream)


def si(x: float, unit: str = "") -> str:
    """1.23 G, 45.6 k, ... with an optional unit."""
    for div, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}".rstrip()


def duration(seconds: float) -> str:
    """A duration in the unit that reads best (s, ms, us)."""
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"


