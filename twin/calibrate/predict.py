"""What the cost model predicts for benchmarked ops: a collective simulated alone on the
cluster by the twin (same algorithms, links and latencies as a full simulation), and a
kernel's ``CostModel.compute_time`` with the measured kind, shape, dtype, FLOPs and bytes.

``modelled_rows`` is the one place these predictions become data: ``paratwin calibrate``
writes them as ``modelled.csv`` and the report draws that file (or, for a bare bench
directory, the rows the CLI computes here with ``model_bench_dir``); the report never simulates.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path

from twin.calibrate.profile import base_kind, bench_op, read_modelled  # noqa: F401 - base_kind: public here
from twin.cost import CostModel, default_cost_model
from twin.rundir import BENCH_META, MODELLED
from twin.schedule.ir import Op, Program
from twin.sim.engine import SimOptions, Simulation
from twin.spec import ClusterSpec, ModelSpec, ParallelPlan, build_job
from twin.vocab import BENCH_ONLY_KINDS, COLLECTIVE_KINDS, COMPUTE_KINDS


def collective_time(kind: str, n: int, nbytes: float, cluster: ClusterSpec, cost: CostModel) -> float:
    """Seconds of one collective of ``nbytes`` over ranks 0..n-1 simulated alone by the twin."""
    gpn = cluster.gpus_per_node
    nodes = max(cluster.num_nodes if n > gpn else 1, math.ceil(n / gpn))
    cl = dataclasses.replace(cluster, num_nodes=nodes)
    dtype = next(iter(cluster.gpu.peak_tflops))
    job = build_job(ModelSpec(dtype=dtype), cl, ParallelPlan())
    members = tuple(range(n))
    if kind == "sendrecv":  # one message from rank 0 to rank 1
        members = (0, 1)
        progs = {0: Program(0, [Op(name="s", kind="send", stream="p2p", bytes=nbytes, peer=1,
                                   tag="bench", group_name="bench")]),
                 1: Program(1, [Op(name="r", kind="recv", stream="p2p", bytes=nbytes, peer=0,
                                   tag="bench", group_name="bench")])}
    else:
        progs = {r: Program(r, [Op(name="bench", kind=kind, stream="comm", phase="opt",
                                   bytes=nbytes, group=members, group_name="bench", root=0)])
                 for r in members}
    sim = Simulation(job, progs, cost, SimOptions(), {r: [r] for r in members})
    return sim.run()


def kernel_time(row: dict, cluster: ClusterSpec, cost: CostModel) -> float:
    """``CostModel.compute_time`` of a synthetic op with the benchmark row's figures."""
    return cost.compute_time(bench_op(row, next(iter(cluster.gpu.peak_tflops))), cluster.gpu)


MODELLED_COLUMNS = ["table", "kind", "dtype", "group_size", "shape", "bytes", "flops",
                    "time_s_median", "time_s_p10", "time_s_p90", "time_s_model", "error"]
"""modelled.csv: one row per benchmarked point, measured beside the profile's prediction;
``error`` = model / measured - 1."""


def modelled_rows(collectives: list[dict], kernels: list[dict], cluster: ClusterSpec,
                  cost: CostModel) -> list[dict]:
    """Measured-vs-modelled rows of bench CSV rows (``profile.read_csv``) under ``cost``.
    Collectives run on the first ``group_size`` ranks of ``cluster``; kernels of kinds the
    cost model does not know are left out."""
    out = []
    for r in collectives:
        n = int(r.get("group_size") or 0)
        if n < 2 or r["kind"] not in (*COLLECTIVE_KINDS, *BENCH_ONLY_KINDS):
            continue
        t = collective_time(str(r["kind"]), n, float(r["bytes"]), cluster, cost)
        out.append(_row("collective", r, t, group_size=n))
    for r in kernels:
        if base_kind(r["kind"]) not in COMPUTE_KINDS:
            continue
        out.append(_row("kernel", r, kernel_time(r, cluster, cost), group_size=""))
    return out


def _row(table: str, r: dict, t: float, group_size) -> dict:
    m = float(r["time_s_median"])
    return {"table": table, "kind": r["kind"], "dtype": r.get("dtype", ""), "group_size": group_size,
            "shape": r.get("shape", ""), "bytes": r.get("bytes", 0.0), "flops": r.get("flops", 0.0),
            "time_s_median": m, "time_s_p10": r.get("time_s_p10", ""),
            "time_s_p90": r.get("time_s_p90", ""), "time_s_model": t, "error": t / m - 1}


Presets = Callable[[str], ClusterSpec]
"""Cluster presets by name (the CLI's conf/cluster/; the libraries never read the config tree)."""


def bench_cluster(run_dir: Path, configured: ClusterSpec | None, name: str | None = None,
                  presets: Presets | None = None) -> tuple[ClusterSpec | None, str]:
    """The cluster the benchmarks in ``run_dir`` ran on: ``name`` (a preset), the directory's
    config (``configured``), or, for a gloo bench (meta.json), cpu_local with its world size;
    else none."""
    if name:
        if presets is None:
            raise ValueError(f"cluster={name}: no presets to look it up in (pass presets=)")
        return presets(name), f"cluster {name} (given)"
    if configured is not None:
        return configured, f"cluster {configured.name} (config.yaml)"
    meta_path = Path(run_dir) / BENCH_META
    try:
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    except (OSError, json.JSONDecodeError):
        meta = {}
    if isinstance(meta, dict) and meta.get("backend") == "gloo" and presets is not None:
        base = presets("cpu_local")
        n = int(meta.get("world_size") or base.gpus_per_node)
        return dataclasses.replace(base, gpus_per_node=n), \
            f"cluster cpu_local with {n} ranks (meta.json says gloo; give cluster=NAME otherwise)"
    return None, ""


def bench_profile(profile_path: Path | None, cluster: ClusterSpec | None) \
        -> tuple[CostModel | None, str]:
    """The directory's profile YAML, else the cluster's published defaults, else none."""
    if profile_path is not None:
        cost = CostModel.load(profile_path)
        return cost, f"profile {Path(profile_path).name} ({cost.name})"
    if cluster is not None:
        return default_cost_model(cluster), "the cluster's default cost model (no profile YAML)"
    return None, ""


def model_bench_dir(run_dir: Path, collectives: list[dict], kernels: list[dict],
                    configured: ClusterSpec | None, profile_path: Path | None,
                    name: str | None = None, presets: Presets | None = None) \
        -> tuple[list[dict], str]:
    """Measured-vs-modelled rows of a directory's bench rows (``profile.read_csv``) and a note
    on the model used: the directory's ``modelled.csv`` when ``paratwin calibrate`` wrote one
    and no cluster is named, else computed now; no rows (and the note says why) when the
    directory does not say which cluster the benchmarks ran on."""
    run_dir = Path(run_dir)
    if not name and (run_dir / MODELLED).is_file():
        return read_modelled(run_dir / MODELLED), \
            f"model: {MODELLED} (the profile paratwin calibrate fitted there)"
    cluster, on = bench_cluster(run_dir, configured, name, presets)
    cost, where = bench_profile(profile_path, cluster)
    if cluster is None or cost is None:
        return [], ("the directory does not say which cluster the benchmarks ran on, so only the "
                    "measured points are drawn; give cluster=NAME (a conf/cluster preset) to draw "
                    "the model")
    return modelled_rows(collectives, kernels, cluster, cost), f"model: {where} on {on}"
