"""The fields a fit from step times frees: per cluster kind, their bounds, and how a
parameter vector reads from and writes into a profile (twin.calibrate.stepfit fits them)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from twin.cost import CostModel
from twin.spec import ClusterSpec

LAUNCH_MAX_US = 30.0
"""A kernel's device-side overhead (launch gap, tail) is microseconds; a fixed cost per op
beyond that is the host's (dispatch, autograd, several kernels per op), which the host
issue time models: bounding the device side keeps the two apart."""
FREE: tuple[tuple[str | None, str, float, float], ...] = (
    # (kernel kind or None for the model itself, field, lower, upper)
    ("gemm", "efficiency", 0.05, 1.0),
    ("gemm", "tile_exponent", 0.01, 1.0),
    ("gemm", "launch_us", 0.1, LAUNCH_MAX_US),
    ("gemm", "host_us", 0.1, 500.0),
    ("attention", "efficiency", 0.02, 1.0),
    ("attention", "mem_efficiency", 0.02, 2.0),
    ("attention", "launch_us", 0.1, LAUNCH_MAX_US),
    ("attention", "host_us", 0.1, 1000.0),
    ("elementwise", "mem_efficiency", 0.02, 2.0),
    ("elementwise", "launch_us", 0.1, LAUNCH_MAX_US),
    ("elementwise", "host_us", 0.1, 500.0),
    ("optimizer", "mem_efficiency", 0.02, 2.0),
    ("optimizer", "host_us", 0.1, 5000.0),
    (None, "host_comm_us", 0.1, 1000.0),
    (None, "p2p_latency_us", 0.1, 1000.0),
    (None, "host_comm_per_rank_us", 0.1, 500.0),
)
HALF_FLOPS = ("gemm", "half_flops", 1e6, 1e12)
HALF_FLOPS_START = 2e10
"""Where the size curve starts when the base has none: half the ceiling at about a 2048-cube GEMM."""
CPU_FREE: tuple[tuple[str | None, str, float, float], ...] = (
    # a shared-CPU rank runs its kernels on the thread that issues them: the framework's
    # cost per op (dispatch, autograd, the eager optimizer's per-tensor loop) is time on
    # that core, so it is fitted as each kind's per-op overhead (launch_us), not host_us
    ("gemm", "efficiency", 0.05, 4.0),
    ("gemm", "launch_us", 0.1, 5000.0),
    ("attention", "efficiency", 0.02, 2.0),
    ("attention", "launch_us", 0.1, 5000.0),
    ("elementwise", "mem_efficiency", 0.02, 2.0),
    ("elementwise", "launch_us", 0.1, 5000.0),
    ("optimizer", "mem_efficiency", 0.02, 2.0),
    ("optimizer", "launch_us", 0.1, 50000.0),
    (None, "host_comm_us", 0.1, 5000.0),
    (None, "p2p_latency_us", 0.1, 5000.0),
)
BY_ROLE = "host_comm_by_group_us"
CPU_CALLS = tuple((None, f"{BY_ROLE}.{role}", 0.1, 50000.0) for role in ("dp", "fsdp", "tp")) \
    + ((None, "host_tp_gemm_us", 0.1, 50000.0),)
"""A shared-CPU step fit from a traces profile also frees the host time of a call per group
role: the framework layer issuing it costs its own on the computing thread (DDP's and FSDP's
hooks on dp, DTensor's redistribution on tp; twin.sim.thread), and DTensor's dispatch of
each tensor-parallel GEMM."""
CPU_STEP_FREE = tuple(f for f in CPU_FREE if f[0] in (None, "optimizer") or f[1] == "launch_us") \
    + CPU_CALLS
"""A shared-CPU fit that starts from a traces profile (``calibrate traces=``: the same kernels,
measured op by op): what a framework's real step adds to the replayed ops (each kind's cost
per op, the eager optimizer, issuing collectives and send/recv), the kernels' efficiencies
held as the traces measured them."""


def free_for(cluster: ClusterSpec, gemm_ceiling: bool = False, base: CostModel | None = None) -> tuple:
    """What a fit from step times frees on ``cluster``: CPU_FREE on shared-CPU ranks (CPU_STEP_FREE
    from a ``base`` fitted on traces), else FREE; with a ``gemm_ceiling`` the GEMMs' size curve
    (half_flops) instead of their efficiency."""
    if cluster.intra.kind == "shared_cpu":
        traced = base is not None and isinstance(base.provenance, dict) and \
            base.provenance.get("source") == "traces"
        return CPU_STEP_FREE if traced else CPU_FREE
    if gemm_ceiling:
        return tuple(HALF_FLOPS if f[:2] == ("gemm", "efficiency") else f for f in FREE)
    return FREE


def get(cost: CostModel, kind: str | None, name: str, dtype: str = "") -> float:
    """A FREE field's value in ``cost`` (a kernel field: the kernel ``dtype``'s ops use)."""
    if name.startswith(BY_ROLE + "."):
        return cost.comm_host_us(name[len(BY_ROLE) + 1:])
    obj = cost if kind is None else cost.kernel(kind, dtype)
    v = getattr(obj, name)
    return float(v) if v is not None else 1.0


def with_params(cost: CostModel, values: Sequence[float], free=FREE,
                dtypes: Sequence[str] = ()) -> CostModel:
    """``cost`` with the FREE fields set to ``values``: in each kind's default kernel and, for
    the ``dtypes`` the runs use, in the kernel fitted for that dtype (kernels_by_dtype), which
    is the one their ops are timed with."""
    kinds: dict[str, dict] = {}
    top: dict = {}
    for (kind, name, _, _), v in zip(free, values):
        if kind is None and name.startswith(BY_ROLE + "."):
            top[BY_ROLE] = {**top.get(BY_ROLE, cost.host_comm_by_group_us),
                            name[len(BY_ROLE) + 1:]: float(v)}
        elif kind is None:
            top[name] = float(v)
        else:
            kinds.setdefault(kind, {})[name] = float(v)
    for kind, changes in kinds.items():
        top[kind] = dataclasses.replace(getattr(cost, kind), **changes)
    by_dtype = {dt: dict(ks) for dt, ks in cost.kernels_by_dtype.items()}
    for dt in dtypes:
        for kind, changes in kinds.items():
            if kind in by_dtype.get(dt, {}):
                by_dtype[dt][kind] = dataclasses.replace(by_dtype[dt][kind], **changes)
    return dataclasses.replace(cost, **top, kernels_by_dtype=by_dtype)


def restore(cost: CostModel, keep: CostModel, fields, dtypes: Sequence[str] = ()) -> CostModel:
    """``cost`` with the FREE ``fields`` as ``keep`` has them (what a fit could not measure
    goes back to what it was given): a group role ``keep`` leaves to ``host_comm_us`` is left
    to it again, a kernel field is taken from ``keep``'s kernel of each of the ``dtypes``."""
    roles = dict(cost.host_comm_by_group_us)
    top: dict = {}
    kinds: dict[str, list[str]] = {}
    for kind, name, _, _ in fields:
        if kind is None and name.startswith(BY_ROLE + "."):
            role = name[len(BY_ROLE) + 1:]
            if role in keep.host_comm_by_group_us:
                roles[role] = keep.host_comm_by_group_us[role]
            else:
                roles.pop(role, None)
        elif kind is None:
            top[name] = getattr(keep, name)
        else:
            kinds.setdefault(kind, []).append(name)
    for kind, names in kinds.items():
        top[kind] = dataclasses.replace(getattr(cost, kind),
                                        **{n: getattr(getattr(keep, kind), n) for n in names})
    by_dtype = {dt: dict(ks) for dt, ks in cost.kernels_by_dtype.items()}
    for dt in dtypes:
        for kind, names in kinds.items():
            if kind in by_dtype.get(dt, {}):
                by_dtype[dt][kind] = dataclasses.replace(
                    by_dtype[dt][kind], **{n: getattr(keep.kernel(kind, dt), n) for n in names})
    return dataclasses.replace(cost, **top, host_comm_by_group_us=roles, kernels_by_dtype=by_dtype)
