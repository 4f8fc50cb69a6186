"""Kernel sweep on one device: GEMM over shapes and dtypes, attention, elementwise, the optimizer step.

Each benchmarked op is built by the twin's own ``ProgramBuilder`` (twin.schedule.emit),
so its FLOPs and bytes are the formulas the twin's cost model reads (GEMM 2mnk FLOPs and
e(mk + kn + mn) bytes; attention 4*b*h*s^2*d forward, 2.5x for the backward; ...), and is
run by the same ``Kernels`` as the replay. Timing: ``perf_counter_ns`` around each call on
CPU; on GPU, CUDA events around each call queued behind a sleeping kernel (the GPU's time
alone) and the host's time to issue it apart (``time_op``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from executor.bench.report import KERNEL_COLUMNS, CsvWriter, spread
from executor.kernels import Kernels
from twin.schedule.emit import Ctx, ProgramBuilder
from twin.schedule.ir import Op
from twin.spec import ClusterSpec, GPUSpec, ModelSpec, ParallelPlan, build_job


def _builder(dtype: str) -> ProgramBuilder:
    model = ModelSpec(name="bench", num_layers=1, hidden_size=64, num_heads=1, num_kv_heads=1,
                      ffn_hidden_size=64, vocab_size=64, seq_len=64, activation="gelu", dtype=dtype)
    cluster = ClusterSpec(name="bench", num_nodes=1, gpus_per_node=1,
                          gpu=GPUSpec(name="bench", peak_tflops={dtype: 1.0}))
    return ProgramBuilder(build_job(model, cluster, ParallelPlan(dp=1)), 0)


def kernel_ops(spec: dict) -> list[Op]:
    """The ops of a sweep: ``spec`` has dtypes, gemm [[m, n, k]], attention [[b, h, kv, s, d]],
    elementwise [elements], optimizer [params] (lists may be empty)."""
    ops: list[Op] = []
    for dtype in spec.get("dtypes", ["fp32"]):
        b = _builder(dtype)
        ctx = Ctx("bench")
        for m, n, k in spec.get("gemm", []):
            ops.append(b.ops[b.gemm(ctx, f"gemm.{m}x{n}x{k}", m, n, k, [])])
        for batch, heads, kv, seq, d in spec.get("attention", []):
            name = f"{batch}x{heads}x{kv}x{seq}x{d}"
            ops.append(b.ops[b.attention(ctx, f"attn.{name}", batch, heads, kv, seq, d, [])])
            ops.append(b.ops[b.attention(ctx.at(phase="bwd"), f"attn.bwd.{name}", batch, heads,
                                         kv, seq, d, [], flops_scale=2.5)])
        for elements in spec.get("elementwise", []):
            ops.append(b.ops[b.elementwise(ctx, f"add.{elements}", elements, [], tensors=3)])
    for params in spec.get("optimizer", []):
        b = _builder("fp32")
        ops.append(b.ops[b.optimizer(Ctx("bench"), f"adam.{params}", params, [])])
    return ops


FLUSH_BYTES = 64 << 20
"""Bytes written between timed calls so each starts with cold caches, as inside a training
step where other ops ran in between (Triton's do_bench flushes the L2 the same way)."""

SLEEP_CYCLES = 20_000_000
"""GPU clock cycles the device sleeps before a repeat's calls (about 10 ms at 2 GHz): long
enough for the host to queue them all behind it, four times longer on each retry."""


def time_op(kernels: Kernels, op: Op, repeats: int, warmup: int,
            log=print) -> tuple[list[float], list[float] | None]:
    """Seconds per call of ``op``, ``repeats`` times after ``warmup`` untimed calls, with the
    caches flushed (untimed) before each timed call; and on a GPU the host's seconds to issue
    each call (None on CPU, where the call is the host's own work).

    On CPU a call is timed by the clock around it. On a GPU the calls are queued behind a
    sleeping kernel (``torch.cuda._sleep``) and timed by CUDA events between them, so a
    call's time is the GPU's alone: the host's dispatch and launch, which a training step
    hides behind earlier kernels (or pays, when its kernels are small), is timed apart as the
    clock around the call while the GPU sleeps (the cost model's ``launch_us`` and
    ``host_us``). Timing each call alone after a synchronize would add the host's launch
    lag to every small kernel's time."""
    scratch = torch.empty(FLUSH_BYTES // 4, dtype=torch.float32, device=kernels.device)
    for _ in range(warmup):
        kernels.run(op)
    if kernels.device.type != "cuda":
        times = []
        for _ in range(repeats):
            scratch.fill_(1.0)
            t0 = time.perf_counter_ns()
            kernels.run(op)
            times.append((time.perf_counter_ns() - t0) / 1e9)
        return times, None
    return _time_cuda(kernels, op, repeats, scratch, log)


def _time_cuda(kernels: Kernels, op: Op, repeats: int, scratch: torch.Tensor,
               log) -> tuple[list[float], list[float]]:
    sleep = getattr(torch.cuda, "_sleep", None)
    cycles = SLEEP_CYCLES
    for attempt in range(3):
        torch.cuda.synchronize(kernels.device)
        if sleep is not None:
            sleep(cycles)
        gate = torch.cuda.Event()
        gate.record()
        events, host = [], []
        for _ in range(repeats):
            scratch.fill_(1.0)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter_ns()
            kernels.run(op)
            host.append((time.perf_counter_ns() - t0) / 1e9)
            end.record()
            events.append((start, end))
        covered = sleep is not None and not gate.query()  # the GPU slept until all were queued
        torch.cuda.synchronize(kernels.device)
        if covered or sleep is None or attempt == 2:
            break
        cycles *= 4
    if not covered:
        log(f"  {op.name}: the host did not queue its calls while the GPU slept "
            f"({'no torch.cuda._sleep' if sleep is None else 'it synchronizes'}): "
            "its times include the host's launch")
    return [s.elapsed_time(e) / 1e3 for s, e in events], host


def run_kernel_sweep(ops: Iterable[Op], device: torch.device, csv_path, repeats: int,
                     warmup: int, log=print) -> list[dict]:
    """Time every op; write one CSV row per op (flushed as it goes); return the rows."""
    writer = CsvWriter(csv_path, KERNEL_COLUMNS)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows = []
    for op in ops:
        kernels = Kernels(device)  # fresh inputs per op: memory stays one op's worth
        times, host = time_op(kernels, op, repeats, warmup, log)
        stats = spread(times)
        t = stats["time_s_median"]
        row = {"kind": op.kind + (".bwd" if op.phase == "bwd" else ""), "dtype": op.dtype,
               "shape": "x".join(str(int(x)) for x in op.shape), "flops": op.flops,
               "bytes": op.bytes, **stats, "tflops": op.flops / t / 1e12 if t else 0.0,
               "GBps": op.bytes / t / 1e9 if t else 0.0, "device": name,
               "host_s_median": spread(host)["time_s_median"] if host else ""}
        writer.row(row)
        rows.append(row)
        log(f"{row['kind']:<15} {row['dtype']:<5} {row['shape']:<22} {t * 1e6:>10.1f} us "
            f"{row['tflops']:>9.4f} TFLOP/s {row['GBps']:>9.2f} GB/s"
            + (f"   host {row['host_s_median'] * 1e6:.1f} us" if host else ""))
        del kernels
    return rows
