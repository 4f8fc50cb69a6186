"""Compute ops as real kernels of the op's shape and dtype: GEMM, attention, elementwise, Adam.

Inputs are made once per (kind, shape, dtype) and reused, so a step times kernels, not
allocation. What each kind runs:

- gemm (m, n, k): ``torch.mm`` of an (m x k) and a (k x n) matrix into an (m x n) output;
- attention (batch, heads, kv_heads, seq, head_dim, causal[, kv_seq]): ``scaled_dot_product_attention``
  of seq queries over kv_seq keys (default seq; a context-parallel block; GQA when
  kv_heads < heads); an op whose FLOPs exceed 1.5x the forward's (the backward,
  2x or 2.5x in twin.schedule.tensor) runs the SDPA backward through autograd over a
  forward built once at first use;
- elementwise (elements,) or (elements, 1) (one kernel eager too, Op.one_kernel; timed alike
  here): a memory-bound kernel touching ``bytes / (elements * e)``
  tensors of ``elements`` (1: fill, 2: scale, 3: add, 4+: addcmul);
- optimizer (params, fused): ``torch.optim.Adam(fused=True)`` (or ``foreach=True``) over one
  flat fp32 parameter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from twin.schedule.ir import Op

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp8": torch.float8_e4m3fn, "mxfp8": torch.float8_e4m3fn}


FP8_GEMMS = ("fp8", "mxfp8")
"""GEMM dtypes of FP8 training (parallel.float8): replayed with torch._scaled_mm."""


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a paratwin dtype name ('' means fp32)."""
    try:
        return DTYPES[name or "fp32"]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(DTYPES)}") from None


def _rand(shape, dtype, device) -> torch.Tensor:
    # small values: no overflow in bf16/fp16, no denormals
    return (torch.rand(shape, device=device, dtype=torch.float32) * 0.02 - 0.01).to(dtype)


class Kernels:
    """Runs compute ops on ``device``; remembers the inputs it made (``workspace_bytes``)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._cache: dict[tuple, object] = {}

    @property
    def workspace_bytes(self) -> int:
        """Bytes of the inputs, outputs and optimizer states held for reuse."""
        total = 0
        for item in self._cache.values():
            for t in (item if isinstance(item, tuple) else (item,)):
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
                elif isinstance(t, torch.optim.Optimizer):
                    for state in t.state.values():
                        total += sum(v.numel() * v.element_size() for v in state.values()
                                     if isinstance(v, torch.Tensor))
                    for group in t.param_groups:
                        total += sum(2 * p.numel() * p.element_size() for p in group["params"])
        return total

    def run(self, op: Op) -> None:
        """Run one compute op (synchronously on CPU; enqueued on the current stream on GPU)."""
        if op.kind == "gemm":
            self.gemm(op.shape, op.dtype)
        elif op.kind == "attention":
            self.attention(op.shape, op.dtype, backward=op.flops > 1.5 * attention_flops(op.shape))
        elif op.kind == "elementwise":
            e = torch_dtype(op.dtype).itemsize
            elements = int(op.shape[0]) if op.shape else 0
            tensors = round(op.bytes / (elements * e)) if elements else 2
            self.elementwise(elements, op.dtype, tensors)
        elif op.kind == "optimizer":
            self.optimizer(int(op.shape[0]) if op.shape else 0,
                           fused=len(op.shape) < 2 or bool(op.shape[1]))
        else:
            raise ValueError(f"{op.name}: {op.kind} is not a compute op")

    def gemm(self, shape, dtype: str) -> None:
        m, n, k = (int(x) for x in shape)
        key = ("gemm", m, n, k, dtype)
        if dtype in FP8_GEMMS:  # torch._scaled_mm: e4m3 operands (b column-major), bf16 out
            if key not in self._cache:  # (mxfp8's block scales: per-tensor scales here)
                a = _rand((m, k), torch.float32, self.device).to(torch.float8_e4m3fn)
                b = _rand((n, k), torch.float32, self.device).to(torch.float8_e4m3fn).t()
                one = torch.ones((), device=self.device)
                self._cache[key] = (a, b, one)
            a, b, one = self._cache[key]
            torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
            return
        if key not in self._cache:
            dt = torch_dtype(dtype)
            self._cache[key] = (_rand((m, k), dt, self.device), _rand((k, n), dt, self.device),
                                torch.empty((m, n), dtype=dt, device=self.device))
        a, b, c = self._cache[key]
        torch.mm(a, b, out=c)

    def attention(self, shape, dtype: str, backward: bool = False) -> None:
        batch, heads, kv_heads, seq, head_dim, causal = (int(x) for x in shape[:6])
        kv_seq = int(shape[6]) if len(shape) > 6 else seq
        key = ("attention", batch, heads, kv_heads, seq, head_dim, causal, kv_seq, dtype, backward)
        if key not in self._cache:
            dt = torch_dtype(dtype)
            q = _rand((batch, heads, seq, head_dim), dt, self.device)
            k = _rand((batch, kv_heads, kv_seq, head_dim), dt, self.device)
            v = _rand((batch, kv_heads, kv_seq, head_dim), dt, self.device)
            if backward:
                q, k, v = (t.requires_grad_() for t in (q, k, v))
                out = F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal),
                                                     enable_gqa=heads != kv_heads)
                self._cache[key] = (q, k, v, out, torch.ones_like(out))
            else:
                self._cache[key] = (q, k, v)
        item = self._cache[key]
        if backward:
            q, k, v, out, grad = item
            torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
        else:
            q, k, v = item
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal),
                                               enable_gqa=heads != kv_heads)

    def elementwise(self, elements: int, dtype: str, tensors: int) -> None:
        tensors = max(1, int(tensors))
        key = ("elementwise", elements, dtype, tensors)
        if key not in self._cache:
            dt = torch_dtype(dtype)
            self._cache[key] = tuple(_rand((elements,), dt, self.device)
                                     for _ in range(min(tensors, 4)))
        ts = self._cache[key]
        if tensors == 1:
            ts[0].fill_(0.5)
        elif tensors == 2:
            torch.mul(ts[0], 0.5, out=ts[1])
        elif tensors == 3:
            torch.add(ts[0], ts[1], out=ts[2])
        else:
            torch.addcmul(ts[0], ts[1], ts[2], out=ts[3])
            for _ in range(tensors - 4):  # each further tensor: one more read-modify-write pass
                ts[3].mul_(0.5)

    def optimizer(self, params: int, fused: bool = True) -> None:
        """Adam over one flat fp32 parameter: fused, or PyTorch's foreach implementation."""
        key = ("optimizer", params, fused)
        if key not in self._cache:
            p = torch.nn.Parameter(_rand((max(params, 1),), torch.float32, self.device))
            p.grad = _rand((max(params, 1),), torch.float32, self.device)
            impl = {"fused": True} if fused else {"foreach": True}
            self._cache[key] = torch.optim.Adam([p], lr=1e-4, **impl)
        self._cache[key].step()


def attention_flops(shape) -> float:
    """Forward FLOPs of the attention core: 4 * b * heads * s * s_kv * d (twin.schedule.emit;
    s_kv = s but in a context-parallel block, twin.schedule.context)."""
    batch, heads, _, seq, head_dim = (int(x) for x in shape[:5])
    kv_seq = int(shape[6]) if len(shape) > 6 else seq
    return 4.0 * batch * heads * seq * kv_seq * head_dim


def workspace_estimate(ops) -> int:
    """Bytes ``Kernels`` will hold to run ``ops``: one set of inputs per distinct shape, plus
    the optimizer's parameter, gradient and two moments (fp32); an upper bound for checks."""
    seen: set[tuple] = set()
    total = 0
    for op in ops:
        if not op.is_compute or (op.kind, op.shape, op.dtype) in seen:
            continue
        seen.add((op.kind, op.shape, op.dtype))
        e = torch_dtype(op.dtype).itemsize
        if op.kind == "gemm":
            m, n, k = op.shape
            total += e * (m * k + k * n) + max(e, 2) * m * n  # FP8: a bf16 output
        elif op.kind == "attention":
            b, h, kv, s, d = op.shape[:5]
            s_kv = op.shape[6] if len(op.shape) > 6 else s
            total += 4 * e * (2 * b * h * s * d + 2 * b * kv * s_kv * d)  # q k v out (+ grads)
        elif op.kind == "elementwise":
            total += e * op.shape[0] * 4
        elif op.kind == "optimizer":
            total += 16 * op.shape[0]
    return total
