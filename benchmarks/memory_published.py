"""Peak memory per GPU: published figures against the memory model (twin/workload/memory.py).

    python benchmarks/memory_published.py

Every figure is torchtitan's "Memory(GiB)" column of benchmarks/llama3_h100_202412_torchtitan.md
(pytorch/torchtitan; runs of 2024-12 with torch 1963fc8 and torchtitan 9dec370 on H100s with
96 GB of HBM2e). torchtitan logs ``torch.cuda.memory_stats()["reserved_bytes.all.peak"]``
(torchtitan/components/metrics.py), the caching allocator's peak reserved bytes, maximum over
ranks, so each is compared with ``Memory.reserved`` of the modelled rank with the highest.
The recipes (train_configs/llama3_*.toml at 9dec370): bf16 params, fp32 reductions
(FSDP2 MixedPrecisionPolicy), AdamW, flash attention (SDPA), sequence 8,192 unless said,
per-layer ``fully_shard`` (reshard after forward except under PP), loss parallel under TP,
and one micro-batch per pipeline stage (pipeline_parallel_microbatches defaults to the PP
degree). What the model does not represent is named in ``unmodelled``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

if __name__ == "__main__" and __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from twin.spec import ClusterSpec, GPUSpec, Job, ModelSpec, ParallelPlan, build_job  # noqa: E402
from twin.workload.memory import Memory, rank_memory  # noqa: E402

GIB = 2 ** 30
SOURCE = ("pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md "
          "(commit b5bcd76c66d0acb1a08b176d9639425bc55e0b2a)")


def llama31(size: str, seq_len: int = 8192) -> ModelSpec:
    """Llama 3.1 8B / 70B / 405B (Llama 3 paper, Table 3; tokenizer's 128,256 entries)."""
    layers, hidden, heads, ffn = {"8B": (32, 4096, 32, 14336), "70B": (80, 8192, 64, 28672),
                                  "405B": (126, 16384, 128, 53248)}[size]
    return ModelSpec(name=f"llama3.1_{size}", num_layers=layers, hidden_size=hidden,
                     num_heads=heads, num_kv_heads=8, ffn_hidden_size=ffn, vocab_size=128256,
                     seq_len=seq_len, activation="swiglu", dtype="bf16")


def grand_teton(gpus: int) -> ClusterSpec:
    """torchtitan's H100 hosts: 8 GPUs on NVLink, 96 GB HBM2e, 400 Gb/s per GPU."""
    return ClusterSpec(name="grand_teton_h100", num_nodes=gpus // 8, gpus_per_node=8,
                       gpu=GPUSpec(name="H100-HBM2e-96GB", peak_tflops={"bf16": 989.0},
                                   hbm_GB=96.0, hbm_bw_GBps=2400.0, sm_count=132))


@dataclass(frozen=True)
class Case:
    """One published peak: the run as a paratwin job, the figure, and the tolerance."""

    name: str
    where: str
    published_gib: float
    model: ModelSpec
    gpus: int
    plan: ParallelPlan
    recompute: str | None = None
    """Overrides the plan's policy in the memory model ("op": torchtitan's op-level SAC)."""
    tolerance: float = 0.10
    unmodelled: tuple[str, ...] = field(default_factory=tuple)

    def job(self) -> Job:
        return build_job(self.model, grand_teton(self.gpus), self.plan)

    def modelled(self) -> tuple[int, Memory]:
        """The listed rank with the highest modelled reserved bytes (first rank of each stage)."""
        job = self.job()
        ranks = [job.grid.rank(pp=s) for s in range(job.parallel.pp)]
        return max(((r, rank_memory(job, r, self.recompute)) for r in ranks),
                   key=lambda rm: rm[1].reserved)


FSDP = dict(zero_stage=3, flash_attention=True)
CASES = (
    Case("8B FSDP-8, selective (op) AC", "Table 1, row FSDP", 82.4, llama31("8B"), 8,
         ParallelPlan(micro_batch_size=2, global_batch_size=16, recompute="selective", **FSDP),
         recompute="op"),
    Case("8B FSDP-128, selective (op) AC", "Table 3, row FSDP", 67.0, llama31("8B"), 128,
         ParallelPlan(micro_batch_size=2, global_batch_size=256, recompute="selective", **FSDP),
         recompute="op"),
    Case("8B FSDP-8, full AC, seq 32k", "Table 2, row FSDP 8, CP 1", 83.9,
         llama31("8B", seq_len=32768), 8,
         ParallelPlan(micro_batch_size=1, global_batch_size=8, recompute="full", **FSDP),
         unmodelled=("torch.compile", "Float8 linears")),
    Case("70B FSDP-32 x TP-8, full AC", "Table 4, row 2D", 71.9, llama31("70B"), 256,
         ParallelPlan(tp=8, sp=True, micro_batch_size=16, global_batch_size=512,
                      recompute="full", **FSDP),
         unmodelled=("torch.compile", "Float8 linears")),
    Case("405B FSDP-8 x TP-8 x PP-8 1F1B, full AC", "Table 5, row 1F1B", 82.5, llama31("405B"),
         512, ParallelPlan(tp=8, sp=True, pp=8, pp_schedule="1f1b", micro_batch_size=4,
                           global_batch_size=256, recompute="full",
                           fsdp_reshard_after_forward=False, grad_sync="last",
                           pp_stage_layers=[15, 16, 16, 16, 16, 16, 16, 15], **FSDP),
         tolerance=0.15,
         unmodelled=("torch.compile", "Float8 linears and all-gathers", "async TP",
                     "the stage split (not published; 15/16 layers assumed)",
                     "pipelining's per-micro-batch receive buffers")),
)

CATEGORIES = ("params", "grads", "optimizer", "activations", "buffers", "temporary",
              "workspace", "allocator_reserve")


def row(case: Case) -> dict:
    rank, mem = case.modelled()
    cats = {c: getattr(mem, c) for c in CATEGORIES}
    top = sorted(cats, key=cats.get, reverse=True)[:3]
    return {"case": case.name, "where": case.where, "rank": rank,
            "published_gib": case.published_gib, "modelled_gib": mem.reserved / GIB,
            "error": mem.reserved / GIB / case.published_gib - 1, "tolerance": case.tolerance,
            "dominant": ", ".join(f"{c} {cats[c] / GIB:.1f}" for c in top),
            "tensors_gib": mem.tensors / GIB, "allocated_gib": mem.allocated / GIB,
            "device_total_gib": mem.total / GIB}


def main() -> None:
    print(f"Peak reserved memory per GPU, GiB: published ({SOURCE}) vs modelled (Memory.reserved)")
    print("(tensors: the static model before the new categories; alloc: + temporary and workspace)")
    print(f"{'case':<42} {'source':<26} {'pub':>6} {'model':>6} {'error':>7} {'tol':>5} "
          f"{'tensors':>8} {'alloc':>6}  dominant categories (GiB)")
    for case in CASES:
        r = row(case)
        print(f"{r['case']:<42} {r['where']:<26} {r['published_gib']:>6.1f} "
              f"{r['modelled_gib']:>6.1f} {r['error']:>+7.1%} {r['tolerance']:>5.0%} "
              f"{r['tensors_gib']:>8.1f} {r['allocated_gib']:>6.1f}  {r['dominant']}")
    print("\nNot modelled (the published runs used them): "
          + "; ".join(f"{c.name}: {', '.join(c.unmodelled)}" for c in CASES if c.unmodelled))


if __name__ == "__main__":
    main()
