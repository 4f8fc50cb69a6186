"""What an op's shape does to its kernel's time: the FLOPs it is timed by, GEMM tiles and
waves, the alignment cuBLAS's tensor-core kernels need, and the key of a measured shape.
The cost model (twin/cost.py) applies them; split from it to keep each module one subject."""

from __future__ import annotations

from twin.schedule.ir import Op


def shape_key(op: Op) -> str:
    """The key of a kernel shape in ``CostModel.shape_factors``: kind, dtype and shape, e.g.
    ``gemm:fp16:2048x1536x1024`` (gemm m x n x k; attention batch x heads x kv_heads x seq x
    head_dim x flash)."""
    return f"{op.kind}:{op.dtype or 'bf16'}:{'x'.join(str(int(d)) for d in op.shape)}"


ALIGN_BYTES = 16
"""The alignment of a GEMM's leading dimensions that cuBLAS's tensor-core kernels need."""
ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "mxfp8": 1}


def gemm_aligned(op: Op) -> bool:
    """Whether a GEMM's n and k (shape (m, n, k)) are multiples of ALIGN_BYTES in its dtype;
    m does not matter (it is no leading dimension of a row-major product)."""
    if len(op.shape) < 3:
        return True
    step = ALIGN_BYTES // ELEMENT_BYTES.get(op.dtype or "bf16", 2)
    return op.shape[1] % step == 0 and op.shape[2] % step == 0


def timed_flops(op: Op) -> float:
    """The FLOPs a compute op is timed by: a causal attention kernel skips the masked half."""
    causal = op.kind == "attention" and len(op.shape) > 5 and op.shape[5]
    return op.flops * (0.5 if causal else 1.0)


def gemm_utilization(m: int, n: int, tile: int, sm_count: int | None = None) -> float:
    """Fraction of the GPU an m x n GEMM output keeps busy: its useful share of the padded
    tiles, times the share of SMs busy over its waves (tiles / (waves * sm_count))."""
    tm, tn = -(-int(m) // tile), -(-int(n) // tile)
    tiles = tm * tn
    util = (m * n) / (tiles * tile * tile)
    if sm_count:
        waves = -(-tiles // sm_count)
        util *= tiles / (waves * sm_count)
    return util
