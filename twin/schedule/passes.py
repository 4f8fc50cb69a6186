"""The pass interface: hooks a paradigm uses to add its ops around each unit and at step end.

A step is built by walking every chunk's units (embedding, layers, head) in the pipeline
table's order. Each paradigm is one ``Pass``; the passes are applied in a fixed order
(twin/schedule/step.py) and each later pass wraps the earlier ones, like torchtitan's
``apply_tp`` -> ``apply_ac`` -> ``apply_fsdp``: around a unit, ``before`` runs from the
outermost pass inwards and ``after`` from the innermost outwards (the way nested module
wrappers run their pre- and post-hooks). A hook may add the ops the unit's body waits for
(``Unit.deps``), replace its input (``Unit.x``), and read what it produced (``Unit.out``,
``Unit.grads``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from twin.schedule.emit import Ctx, Idx

EMBED, LAYER, HEAD_UNIT = "embed", "layer", "head"


@dataclass
class Unit:
    """One unit's forward or backward on one micro-batch: what the passes see and change."""

    kind: str
    """``embed``, ``layer`` or ``head``."""
    key: int
    """Tensor key: ROOT (embedding), the layer index, or HEAD (final norm and head)."""
    ctx: Ctx
    """Labels of the unit's ops (phase ``fwd`` or ``bwd``, micro-batch, chunk, layer)."""
    next_layer: int | None = None
    """The chunk's next layer in this direction's execution order, if any."""
    x: Idx = None
    """The op producing the body's input."""
    deps: list[Idx] = field(default_factory=list)
    """Other ops the body waits for (e.g. its parameters' all-gather)."""
    recompute_attention: Idx = None
    """Backward: the attention core recomputed just before (selective recomputation)."""
    recompute: Callable[[], Idx] | None = None
    """Backward: emits the layer's recomputation where the body first needs it (PyTorch's
    non-reentrant checkpoint, twin/schedule/recompute.py); None: recomputed before the body."""
    out: Idx = None
    """The op producing the body's output."""
    grads: dict[str, int] = field(default_factory=dict)
    """Backward: local grad op name -> op after which that gradient is ready."""

    @property
    def backward(self) -> bool:
        return self.ctx.phase == "bwd"


class Pass:
    """A paradigm's hooks; every hook is a no-op unless the paradigm overrides it."""

    def before(self, unit: Unit) -> None:
        """Before a unit's body (forward or backward)."""

    def after(self, unit: Unit) -> None:
        """After a unit's body."""

    def grads_reduced(self) -> list[Idx]:
        """Step end: the gradient collectives the optimizer waits for."""
        return []

    def finalize_grads(self, ctx: Ctx, waits: list[Idx]) -> list[Idx]:
        """Step end, once gradients are reduced: further gradient collectives."""
        return []

    def after_optimizer(self, ctx: Ctx, step: Idx) -> None:
        """Step end, after the optimizer step."""

    def action_key(self, mb: int) -> tuple | None:
        """What, besides the micro-batch's labels, this pass's ops in an action of micro-batch
        ``mb`` depend on, for stamping whole actions (twin/schedule/actions.py); None (the
        default): it cannot say (it keeps state across actions), and actions stay generic."""
        return None
