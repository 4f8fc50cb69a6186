"""Kernel shape factors inside a fit: which freed shape each op belongs to, the ops' times
with their factors, and the exact derivative of a sum of those times by each log factor.
Shared by the step-time fit (twin.calibrate.stepfit) and the kind targets
(twin.calibrate.kindtime)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.sparse import csr_matrix

from twin.cost import SHAPED_KINDS, CostModel
from twin.kernelshape import shape_key
from twin.schedule.ir import Op


def shape_columns(ops: Sequence[Op], keys: Sequence[str]) -> np.ndarray:
    """Per op, the index of its shape in ``keys`` (-1: not a freed shape)."""
    column = {k: i for i, k in enumerate(keys)}
    return np.array([column.get(shape_key(op), -1) if op.kind in SHAPED_KINDS else -1
                     for op in ops], int)


def shaped_times(cost: CostModel, ops: Sequence[Op], gpu, shape_of: np.ndarray,
                 shape_logs=()) -> tuple[np.ndarray, np.ndarray]:
    """(each op's time under ``cost`` with its shape's factor exp(log) on the roofline part,
    not the launch; the shaped roofline seconds of each op, 0 where it has no freed shape)."""
    times = np.array([cost.compute_time(op, gpu) for op in ops])
    shaped = np.zeros(len(ops))
    has = shape_of >= 0
    if has.any():
        launch = np.array([cost.kernel(op.kind, op.dtype).launch_us * 1e-6 for op in ops])
        factor = np.exp(np.asarray(shape_logs, float))[shape_of[has]]
        shaped[has] = (times[has] - launch[has]) * factor
        times[has] = shaped[has] + launch[has]
    return times, shaped


def shape_pick(shaped: np.ndarray, shape_of: np.ndarray, n: int) -> csr_matrix:
    """ops x shapes: each op's shaped seconds in its shape's column. ``counts @ pick`` is the
    derivative of ``counts @ times`` by each log factor."""
    has = np.flatnonzero(shape_of >= 0)
    return csr_matrix((shaped[has], (has, shape_of[has])), shape=(len(shape_of), n))
