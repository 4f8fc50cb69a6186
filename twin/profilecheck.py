"""Checks of a calibration profile's data: every key known, every number in its range.

``profile_problems`` lists each problem with its key path (``CostModel.from_dict`` raises
them as one ConfigError); split from twin/cost.py, which holds the model itself.
"""

from __future__ import annotations

import difflib
import math

from twin.vocab import COMPUTE_KINDS

_POSITIVE, _NON_NEGATIVE = "a finite number > 0", "a finite number >= 0"
KERNEL_RANGES = {"efficiency": (_POSITIVE, "fraction of peak FLOP/s reached"),
                 "half_flops": (_NON_NEGATIVE, "FLOPs at half efficiency; 0: flat"),
                 "mem_efficiency": (_POSITIVE, "fraction of HBM bandwidth reached"),
                 "launch_us": (_NON_NEGATIVE, "fixed cost per op, us"),
                 "host_us": (_NON_NEGATIVE, "host time to issue one op, us"),
                 "tile": (_NON_NEGATIVE, "GEMM output tile edge; 0: none"),
                 "tile_exponent": (_NON_NEGATIVE, "share of the tile and wave loss paid"),
                 "unaligned_efficiency": (_POSITIVE, "share kept by a GEMM of unaligned n or k")}
LINK_RANGES = {"bw_efficiency": (_POSITIVE, "fraction of the line rate reached"),
               "latency_us": (_NON_NEGATIVE, "per-hop latency, us; null: the cluster's")}
SCALAR_RANGES = {"base_latency_us": (_NON_NEGATIVE, "fixed cost of a collective, us"),
                 "host_comm_us": (_NON_NEGATIVE, "host time to issue a collective, us"),
                 "host_comm_per_rank_us": (_NON_NEGATIVE, "host time per group member, us"),
                 "p2p_latency_us": (_NON_NEGATIVE, "fixed cost of a send/recv, us"),
                 "overlap_slowdown": (_NON_NEGATIVE, "0.2: compute 20% slower beside comm"),
                 "cores_effective": (_POSITIVE, "cores the ranks share"),
                 "busy_handoff_us": (_NON_NEGATIVE, "a call's wait for a busy core, us"),
                 "host_tp_gemm_us": (_NON_NEGATIVE, "DTensor's host time per TP GEMM, us"),
                 "compute_cv": (_NON_NEGATIVE, "spread of compute times"),
                 "eager_elementwise": (_POSITIVE, "eager bytes over fused, folded in"),
                 "compiled_reduction_efficiency": (_POSITIVE, "compiled norms' share of fused"),
                 "reduction_efficiency": (_POSITIVE, "reductions' share of the kind's"),
                 "comm_cv": (_NON_NEGATIVE, "spread of collective times")}
FIT_RANGES = {"latency_us": (_NON_NEGATIVE, "us"), "bw_GBps": (_POSITIVE, "GB/s")}
FIT_EXTRA = ("residual_median", "residual_max", "points")
NULLABLE = {"latency_us", "p2p_latency_us", "cores_effective"}


def _unknown(problems: list[str], path: str, keys: list, known) -> None:
    """One problem for the unknown keys of one section, each with its closest known key."""
    if not keys:
        return
    parts, lost = [], False
    for key in keys:
        near = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.6)
        parts.append(f"{path}{key}" + (f" (did you mean {path}{near[0]}?)" if near else ""))
        lost = lost or not near
    where = f" of {path[:-1]}" if path else ""
    problems.append(f"unknown profile fields {', '.join(parts)}"
                    + (f" (the fields{where}: {', '.join(known)})" if lost else ""))


def _number(problems: list[str], path: str, value: object, rule: tuple[str, str],
            nullable: bool) -> None:
    want, meaning = rule
    if value is None and nullable:
        return
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) \
        and math.isfinite(value) and (value > 0 if want == _POSITIVE else value >= 0)
    if not ok:
        problems.append(f"{path}={value!r} must be {want} ({meaning})")


def _section(problems: list[str], path: str, data: object, ranges: dict,
             extra: tuple = ()) -> None:
    """A mapping whose keys are ``ranges`` (+ ``extra``, unchecked) with numbers in range."""
    if not isinstance(data, dict):
        problems.append(f"{path}={data!r} must be a mapping of {', '.join(ranges)}")
        return
    for key, value in data.items():
        if key in ranges:
            _number(problems, f"{path}.{key}", value, ranges[key], key in NULLABLE)
    _unknown(problems, f"{path}.", [k for k in data if k not in ranges and k not in extra],
             [*ranges, *extra])


def profile_problems(data: dict, fields: list[str]) -> list[str]:
    """Every problem of a profile's data (``fields``: the CostModel's), each naming its key
    path (empty: fine)."""
    problems: list[str] = []
    _unknown(problems, "", [k for k in data if k not in fields and k not in ("format", "version")],
             fields)
    for key, value in data.items():
        if key in ("format", "version", "provenance") or key not in fields:
            continue
        if key in COMPUTE_KINDS:
            _section(problems, key, value, KERNEL_RANGES)
        elif key in ("intra", "inter"):
            _section(problems, key, value, LINK_RANGES)
        elif key in SCALAR_RANGES:
            _number(problems, key, value, SCALAR_RANGES[key], key in NULLABLE)
        elif key in ("core_share", "p2p_host_sync") and not isinstance(value, bool):
            problems.append(f"{key}={value!r} must be true or false")
        elif key == "name" and not isinstance(value, str):
            problems.append(f"name={value!r} must be a string")
        elif key == "kernels_by_dtype":
            if not isinstance(value, dict):
                problems.append(f"kernels_by_dtype={value!r} must map dtype -> kind -> kernel")
                continue
            for dtype, kinds in value.items():
                if not isinstance(kinds, dict):
                    problems.append(f"kernels_by_dtype.{dtype}={kinds!r} must map kind -> kernel")
                    continue
                where = f"kernels_by_dtype.{dtype}."
                for kind, kernel in kinds.items():
                    if kind in COMPUTE_KINDS:
                        _section(problems, f"{where}{kind}", kernel, KERNEL_RANGES)
                _unknown(problems, where, [k for k in kinds if k not in COMPUTE_KINDS],
                         COMPUTE_KINDS)
        elif key == "collective_fits":
            _fits(problems, value)
        elif key == "shape_factors":
            _shapes(problems, value)
        elif key == "host_comm_by_group_us":
            if not isinstance(value, dict):
                problems.append(f"host_comm_by_group_us={value!r} must map a group role "
                                "(dp, tp, pp, ...) -> host time to issue one call, us")
                continue
            for role, us in value.items():
                _number(problems, f"host_comm_by_group_us.{role}", us,
                        SCALAR_RANGES["host_comm_us"], False)
    if "provenance" in data and not isinstance(data["provenance"], dict):
        problems.append(f"provenance={data['provenance']!r} must be a mapping")
    return problems


def _fits(problems: list[str], fits: object) -> None:
    if not isinstance(fits, dict):
        problems.append(f"collective_fits={fits!r} must map 'kind/link/n' -> latency_us, bw_GBps")
        return
    for key, fit in fits.items():
        kind, _, rest = str(key).partition("/")
        link, _, n = rest.partition("/")
        n = n.partition("@")[0]  # kind/link/n@role: the fit of one group role's collectives
        if not kind or link not in ("intra", "inter") or not n.isdigit() or int(n) < 1:
            problems.append(f"collective_fits.{key} must be named kind/link/n[@role] with link "
                            "intra or inter and n the group size (e.g. all_reduce/intra/8@tp)")
            continue
        _section(problems, f"collective_fits.{key}", fit, FIT_RANGES, FIT_EXTRA)
        if isinstance(fit, dict) and not set(FIT_RANGES) <= set(fit):
            problems.append(f"collective_fits.{key} needs latency_us and bw_GBps")


def _shapes(problems: list[str], shapes: object) -> None:
    if not isinstance(shapes, dict):
        problems.append(f"shape_factors={shapes!r} must map 'kind:dtype:AxBxC' -> factor")
        return
    for key, factor in shapes.items():
        kind, _, rest = str(key).partition(":")
        dtype, _, dims = rest.partition(":")
        if kind not in ("gemm", "attention") or not dtype \
                or not all(d.isdigit() for d in dims.split("x")):
            problems.append(f"shape_factors.{key} must be named kind:dtype:AxBxC with kind gemm "
                            "or attention (e.g. gemm:fp16:2048x1536x1024)")
            continue
        _number(problems, f"shape_factors.{key}", factor,
                (_POSITIVE, "measured over modelled time of that kernel shape"), False)
