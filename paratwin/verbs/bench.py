"""`paratwin bench`: the collective sweep (spawned ranks) and the kernel sweep (this process), as CSV.

Writes OUT_DIR/collectives.csv, OUT_DIR/kernels.csv (columns in executor/bench/report.py)
and OUT_DIR/meta.json (host, CPU, GPUs, torch version, backend, world size, date).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from omegaconf import OmegaConf

from executor.bench.collectives import KINDS, group_sizes, message_sizes
from executor.kernels import DTYPES
from twin import rundir
from twin.spec import ConfigError
from twin.spec.errors import check_choice


def _ints(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def bench_settings(cfg) -> dict:
    """The sweep's settings from the composed config; every problem at once."""
    c = OmegaConf.to_container(cfg, resolve=True)
    problems: list[str] = []
    what = c.get("what") or []
    if not what or set(what) - {"collectives", "kernels"}:
        problems.append(f"what={what} must list collectives and/or kernels")
    check_choice(problems, "backend", c.get("backend"), ("auto", "gloo", "nccl"))
    check_choice(problems, "format", c.get("format", "text"), ("text", "json"))
    check_choice(problems, "dtype", c.get("dtype"), tuple(DTYPES))
    for key in ("world_size", "min_bytes", "max_bytes", "repeats", "kernel_repeats", "threads",
                "timeout_s"):
        if not _ints(c.get(key)) and not (key == "timeout_s" and isinstance(c.get(key), float)
                                          and c[key] > 0):
            problems.append(f"{key}={c.get(key)!r} must be a positive whole number")
    for key in ("warmup", "kernel_warmup"):
        if not isinstance(c.get(key), int) or c[key] < 0:
            problems.append(f"{key}={c.get(key)!r} must be a whole number >= 0")
    if not _ints(c.get("step_factor")) or c["step_factor"] < 2:
        problems.append(f"step_factor={c.get('step_factor')!r} must be a whole number >= 2")
    if _ints(c.get("min_bytes")) and _ints(c.get("max_bytes")) and c["min_bytes"] > c["max_bytes"]:
        problems.append(f"min_bytes={c['min_bytes']} is above max_bytes={c['max_bytes']}")
    bad = [k for k in c.get("collectives") or [] if k not in KINDS]
    if "collectives" in what and (bad or not c.get("collectives")):
        problems.append(f"collectives={c.get('collectives')} must list kinds among {', '.join(KINDS)}")
    world = c.get("world_size")
    if "collectives" in what and _ints(world):
        if world < 2:
            problems.append(f"world_size={world}: the collective sweep needs at least 2 ranks")
        for g in c.get("group_sizes") or []:
            if not _ints(g) or not 2 <= g <= world:
                problems.append(f"group_sizes has {g!r}; each must be in 2..world_size={world}")
    k = c.get("kernels") or {}
    shapes = {"gemm": 3, "attention": 5}
    for name, n in shapes.items():
        for s in k.get(name) or []:
            if not (isinstance(s, list) and len(s) == n and all(_ints(x) for x in s)):
                problems.append(f"kernels.{name} entry {s!r} must be {n} positive integers")
    for name in ("elementwise", "optimizer"):
        for s in k.get(name) or []:
            if not _ints(s):
                problems.append(f"kernels.{name} entry {s!r} must be a positive integer")
    bad_dt = [d for d in k.get("dtypes") or [] if d not in DTYPES]
    if bad_dt:
        problems.append(f"kernels.dtypes has {bad_dt}; use {', '.join(DTYPES)}")
    if not c.get("out_dir"):
        problems.append("out_dir is empty; give a directory for the CSV files")
    if problems:
        raise ConfigError(problems)
    c["timeout_s"] = float(c["timeout_s"])
    return c


def _local_checks(c: dict) -> str:
    import torch

    backend = c["backend"]
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "collectives" in c["what"] and backend == "nccl" and torch.cuda.device_count() < c["world_size"]:
        raise ConfigError(f"backend=nccl needs a GPU per rank: world_size={c['world_size']} but "
                          f"this host has {torch.cuda.device_count()} GPUs; lower world_size")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("backend=nccl needs CUDA, and this host has no GPU; use backend=gloo")
    return backend


def run(cfg) -> dict:
    from executor.bench.report import machine_meta
    from executor.launch import LaunchError, launch_local

    c = bench_settings(cfg)
    backend = _local_checks(c)
    out = rundir.prepare(Path(c["out_dir"]), "bench", bool(cfg.get("force", False)))
    (out / rundir.CONFIG).write_text(OmegaConf.to_yaml(cfg, resolve=True))
    collectives = "collectives" in c["what"]  # a kernel sweep alone runs one process
    meta = machine_meta(backend, c["world_size"] if collectives else 1, c["threads"])
    if collectives:
        meta["sizes_bytes"] = message_sizes(c["min_bytes"], c["max_bytes"], c["step_factor"])
        meta["group_sizes"] = group_sizes(c["world_size"], c.get("group_sizes"))
    rundir.write_json(out / rundir.BENCH_META, meta)
    files = {"meta": str(out / rundir.BENCH_META)}
    quiet = c["format"] == "json"

    def log(message: str) -> None:
        if not quiet:
            print(message, flush=True)

    if collectives:
        settings = {"task": "bench_collectives", "world_size": c["world_size"],
                    "backend": backend, "threads": c["threads"], "timeout_s": c["timeout_s"],
                    "comm_timeout_s": 2 * c["timeout_s"] + 30,
                    **{k: c[k] for k in ("collectives", "min_bytes", "max_bytes", "step_factor",
                                         "dtype", "repeats", "warmup", "group_sizes")}}
        rundir.write_json(out / rundir.SETTINGS, settings)
        log(f"collectives: {c['world_size']} ranks ({backend}), sizes {c['min_bytes']} B to "
            f"{c['max_bytes']} B; rank 0's log: {rundir.log_path(out, 0)}")
        try:
            launch_local(out, c["world_size"], timeout_s=c["timeout_s"], threads=c["threads"],
                         log=lambda m: print(f"paratwin bench: {m}", file=sys.stderr))
        except LaunchError as err:
            print(f"paratwin bench: {err}", file=sys.stderr)
            sys.exit(1)
        files["collectives"] = str(out / "collectives.csv")
        if not quiet:
            print(rundir.log_path(out, 0).read_text(), end="")
    if "kernels" in c["what"]:
        import torch

        from executor.bench.kernels import kernel_ops, run_kernel_sweep

        torch.set_num_threads(c["threads"])
        device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
        log(f"kernels on {device}:")
        run_kernel_sweep(kernel_ops(c["kernels"]), device, out / "kernels.csv",
                         c["kernel_repeats"], c["kernel_warmup"], log=log)
        files["kernels"] = str(out / "kernels.csv")
    result = {"out_dir": str(out), "files": files, "meta": meta}
    print(json.dumps(result, indent=2) if quiet else f"wrote {', '.join(files.values())}")
    return result
