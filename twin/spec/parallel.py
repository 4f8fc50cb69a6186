"""ParallelPlan: how the model is split over the devices (DP, ZeRO/FSDP, TP, SP, PP)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from twin.spec.errors import check_choice, raise_if

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb_h1", "zb_v", "dualpipev")
V_SCHEDULES = ("zb_v", "dualpipev")  # two chunks per rank, in a V
RECOMPUTE = ("none", "selective", "op", "full")
ZERO_STAGES = (0, 1, 2, 3)
RANK_DIMS = ("tp", "cp", "pp", "dp")
GRAD_SYNC = ("default", "last", "every")
SP_NORM_GRAD_SYNC = ("none", "per_tensor", "coalesced")
OPTIMIZER_KERNELS = ("fused", "foreach")
FLOAT8 = ("none", "tensorwise", "rowwise", "mxfp8")
OPTIMIZER_DTYPES = ("fp32", "bf16")
FSDP_REDUCE_DTYPES = ("fp32", "bf16", "fp16")
OPTIMIZER_STATE_BYTES = {"fp32": 4, "bf16": 2}
CP_METHODS = ("ring", "allgather", "alltoall")
CP_LOAD_BALANCE = ("headtail", "none")


class ConfigWarning(UserWarning):
    """A plan that works but is probably not what the user meant."""


@dataclass(frozen=True)
class ParallelPlan:
    """Degrees of parallelism and the training recipe.

    ``dp=None`` fills the cluster: dp = GPUs / (tp * pp * cp). ``global_batch_size=None``
    means one micro-batch per DP rank without pipelining, and 4*pp micro-batches
    with it (enough for every schedule; set it for real runs).
    """

    dp: int | None = None
    """Data-parallel degree (replicas, or ZeRO/FSDP shards); None: fill the cluster."""
    tp: int = 1
    """Tensor-parallel degree (Megatron column/row split)."""
    pp: int = 1
    """Pipeline stages."""
    cp: int = 1
    """Context parallelism: each sequence split over cp ranks, s/cp tokens each (attention
    exchanges keys and values per cp_method; twin/schedule/context.py)."""
    cp_method: str = "ring"
    """How CP attention sees the other ranks' keys and values: ring (cp steps, the KV chunk
    passed to the next rank by send/recv beside the compute), allgather (one all-gather of
    K and V, reduce-scatter of their gradients: Llama 3), alltoall (DeepSpeed-Ulysses:
    all-to-alls of q, k, v and the output over heads)."""
    cp_load_balance: str = "headtail"
    """Causal work over the CP ranks: headtail (rank i holds chunks i and 2cp-1-i: equal
    work, torch's round-robin load balancer) or none (contiguous chunks: rank i attends to
    chunks 0..i)."""
    sp: bool = False
    """Megatron sequence parallelism (needs tp > 1)."""
    ep: int = 1
    """Expert parallelism (MoE models): routed experts split over ep ranks, tokens exchanged
    by all-to-all; the ranks are borrowed from each stage's tp * cp * dp (twin/spec/experts.py)."""
    etp: int | None = None
    """Expert tensor parallelism: each expert's inner size split over etp ranks; None: tp
    (Megatron's default for expert_tensor_parallel_size)."""
    zero_stage: int = 0
    """0: replicated (DDP); 1: shard optimizer; 2: + gradients; 3: + parameters (FSDP)."""
    dp_replicate: int = 1
    """HSDP (FSDP2 on a 2-D mesh, zero_stage=3): replicas of the sharded model; each shards
    over dp_shard ranks and the reduce-scattered gradients are all-reduced across replicas.
    1: no HSDP (FSDP shards over all dp ranks)."""
    dp_shard: int | None = None
    """HSDP: ranks one replica shards over (dp = dp_replicate * dp_shard); None: dp /
    dp_replicate (build_job resolves it)."""
    fsdp_reshard_after_forward: bool = True
    """ZeRO-3/FSDP: free gathered parameters after forward and gather again for backward."""
    fsdp_reduce_dtype: str = "fp32"
    """ZeRO-3/FSDP: the dtype gradients are reduce-scattered (and, under HSDP, all-reduced)
    in: fp32, torchtitan's default (``mixed_precision_reduce``: a bf16 model's gradients are
    cast up as they are copied into the reduce-scatter's buffer, and twice the bytes move),
    or bf16/fp16 (FSDP2's own default with a low-precision ``param_dtype``)."""
    micro_batch_size: int = 1
    """Sequences per micro-batch b."""
    global_batch_size: int | None = None
    """Sequences per optimizer step B; None: see the class docstring."""
    pp_schedule: str = "1f1b"
    """gpipe, 1f1b, interleaved (1F1B with pp_virtual_stages chunks per rank), zb_h1 (1F1B
    with the backward split into input and weight gradients, Qi et al. 2023), zb_v or
    dualpipev (two chunks per rank in a V: set pp_virtual_stages=2)."""
    pp_schedule_csv: str | None = None
    """A per-rank action table in torch.distributed.pipelining's CSV format (``0F0,0I0,0W0``,
    one row per pipeline rank) to run instead of pp_schedule's."""
    pp_virtual_stages: int = 1
    """Model chunks per pipeline rank v (interleaved only)."""
    recompute: str = "none"
    """Activation recomputation: none, selective (attention core, Megatron's), op (torchtitan's
    op-level selective AC: every other matmul's output and the attention's are kept, the rest
    of the layer recomputed up to what backward needs), or full (whole layer)."""
    recompute_early_stop: bool = False
    """recompute=full as torch.utils.checkpoint's non-reentrant implementation runs it
    (torchtitan's full AC, FSDP2 recipes): the recomputation stops once backward has every
    tensor it needs, so the layer's last GEMM (fc2) and its TP all-reduce or reduce-scatter
    are not re-run; false: the whole layer again (Megatron's). Only recompute=full reads it
    (op-level SAC stops early by itself); dense layers."""
    pp_stage_layers: list[int] | None = None
    """Layers per pipeline stage (uneven splits, e.g. Llama 3 405B: [7, 8 x 14, 7]); None: even."""
    ddp_bucket_MB: float = 25.0
    """DDP gradient bucket size in MB (PyTorch's default 25)."""
    rank_order: str = "tp-cp-pp-dp"
    """Order of the rank grid's axes, innermost (consecutive ranks) first."""
    legacy_dp: bool = False
    """nn.DataParallel: one process drives all dp devices of one node."""
    flash_attention: bool = True
    """Fused attention that keeps no s x s scores (memory as with selective recompute)."""
    grad_sync: str = "default"
    """Gradient sync with several micro-batches: default (DDP and ZeRO-1 on the last
    micro-batch only, like no_sync; ZeRO-2/3 and FSDP every micro-batch), last, or every."""

    sp_norm_grad_sync: str = "none"
    """SP only: how the norm weights' partial gradients (each TP rank saw s/t of the sequence)
    are all-reduced over TP at step end: none (not modelled), per_tensor (one all-reduce per
    norm tensor, as PyTorch's DTensor SequenceParallel does) or coalesced (one for all of
    them, as Megatron's finalize_model_grads does)."""

    optimizer_kernels: str = "fused"
    """How the Adam step runs: fused (one pass over parameters, gradients and states: Apex
    FusedAdam in Megatron, ``fused=True`` in PyTorch) or foreach (PyTorch's default AdamW,
    ``foreach`` or its per-tensor loop: one pass per arithmetic step, about 2.3x the bytes)."""

    float8: str = "none"
    """FP8 training of the transformer layers' linear GEMMs (torchao's Float8Linear, as
    torchtitan's ``model.converters=float8``): none; tensorwise or rowwise dynamic scaling
    (Hopper: the GPU's fp8 peak); mxfp8 (Blackwell: its mxfp8 peak). Each FP8 GEMM casts its
    operands first; the LM head, attention and the rest stay in the model dtype, and MFU is
    then taken against the FP8 peak."""

    float8_fsdp_all_gather: bool = False
    """FSDP all-gathers the FP8 linears' weights at one byte per element, cast on the shard
    before the gather (torchtitan's float8.enable_fsdp_float8_all_gather; tensorwise only)."""

    optimizer_dtype: str = "fp32"
    """Adam's momentum and variance: fp32 (PyTorch's and Megatron's default) or bf16."""

    compile: bool = False
    """torch.compile of each layer (torchtitan's compile.enable): its elementwise chains run
    as fused kernels, so the profile's eager factor (CostModel.eager_elementwise) is taken
    out of their cost; an FP8 cast's amax fuses into its producer. The embedding, final norm
    and gradient clipping stay eager (Op.outside_blocks). False: eager PyTorch."""

    compile_loss: bool = True
    """With ``compile``, the loss is compiled too (torchtitan's compile.components 'loss',
    its default since 2025): the cross-entropy is fused, saves the logits and their
    log-sum-exp instead of the fp32 log-softmax, and its backward makes the logits' gradient
    alone. False: the loss stays eager (torchtitan's December 2024 runs compiled the blocks
    only). Under loss_parallel (tp > 1) the loss is modelled eager, time and memory."""

    async_tp: bool = False
    """Async TP (torchtitan's enable_async_tensor_parallel, micro-pipeline TP): each SP
    all-gather -> GEMM and GEMM -> reduce-scatter pair runs as tp chunked steps, partial
    GEMMs overlapping the ring transfers (twin/schedule/asynctp.py). Needs tp > 1 and sp."""

    def __post_init__(self) -> None:
        if self.pp_stage_layers is not None:
            object.__setattr__(self, "pp_stage_layers", tuple(self.pp_stage_layers))
        problems: list[str] = []
        for name in ("tp", "pp", "micro_batch_size", "pp_virtual_stages"):
            _check_int(problems, name, getattr(self, name))
        _check_int(problems, "dp_replicate", self.dp_replicate)
        _check_int(problems, "ep", self.ep)
        if self.etp is not None:
            _check_int(problems, "etp", self.etp)
        for name in ("dp", "global_batch_size", "dp_shard"):
            if getattr(self, name) is not None:
                _check_int(problems, name, getattr(self, name))
        check_choice(problems, "parallel.zero_stage", self.zero_stage, ZERO_STAGES)
        check_choice(problems, "parallel.pp_schedule", self.pp_schedule, PP_SCHEDULES)
        check_choice(problems, "parallel.recompute", self.recompute, RECOMPUTE)
        check_choice(problems, "parallel.grad_sync", self.grad_sync, GRAD_SYNC)
        check_choice(problems, "parallel.sp_norm_grad_sync", self.sp_norm_grad_sync,
                     SP_NORM_GRAD_SYNC)
        check_choice(problems, "parallel.optimizer_kernels", self.optimizer_kernels,
                     OPTIMIZER_KERNELS)
        check_choice(problems, "parallel.float8", self.float8, FLOAT8)
        check_choice(problems, "parallel.optimizer_dtype", self.optimizer_dtype, OPTIMIZER_DTYPES)
        check_choice(problems, "parallel.fsdp_reduce_dtype", self.fsdp_reduce_dtype,
                     FSDP_REDUCE_DTYPES)
        _check_int(problems, "cp", self.cp)
        check_choice(problems, "parallel.cp_method", self.cp_method, CP_METHODS)
        check_choice(problems, "parallel.cp_load_balance", self.cp_load_balance, CP_LOAD_BALANCE)
        if not (isinstance(self.ddp_bucket_MB, (int, float)) and self.ddp_bucket_MB > 0):
            problems.append(f"parallel.ddp_bucket_MB={self.ddp_bucket_MB!r} must be > 0")
        try:
            _ = self.rank_dims
        except ValueError as err:
            problems.append(str(err))
        raise_if(problems)

        if self.async_tp and self.tp == 1:
            problems.append("parallel.async_tp=true overlaps tensor-parallel communication but "
                            "parallel.tp=1; set parallel.tp > 1 (with sp=true) or async_tp=false")
        elif self.async_tp and not self.sp:
            problems.append("parallel.async_tp=true works on sequence parallelism's all-gathers "
                            "and reduce-scatters (as torchtitan's); set parallel.sp=true or "
                            "async_tp=false")
        if self.float8_fsdp_all_gather and (self.float8 != "tensorwise" or self.zero_stage != 3):
            problems.append("parallel.float8_fsdp_all_gather=true gathers FSDP's FP8 weights: it "
                            f"needs float8=tensorwise and zero_stage=3 (got float8={self.float8}, "
                            f"zero_stage={self.zero_stage}); set them or leave it false")
        if self.async_tp and self.sp and self.tp > 1 and not self.compile:
            problems.append("parallel.async_tp=true is a torch.compile pass (micro-pipeline TP): "
                            "set parallel.compile=true or async_tp=false")
        if self.sp and self.tp == 1:
            problems.append("parallel.sp=true needs tensor parallelism but parallel.tp=1; "
                            "set parallel.tp > 1 or parallel.sp=false")
        if self.recompute == "op" and self.cp > 1:
            problems.append(f"parallel.recompute=op (op-level SAC) is modelled without context "
                            f"parallelism (the recomputation of its KV exchange is not), but "
                            f"cp={self.cp}; set cp=1 or recompute=selective|full")
        if self.recompute == "op" and self.async_tp and self.sp and self.tp > 1:
            problems.append("parallel.recompute=op (op-level SAC) is modelled with TP's own "
                            "collectives, not async TP's fused ones (async_tp=true); set "
                            "async_tp=false or recompute=selective|full")
        if self.pp_schedule == "interleaved":
            if self.pp == 1:
                problems.append("parallel.pp_schedule=interleaved needs parallel.pp > 1; "
                                "set parallel.pp or use pp_schedule=1f1b")
            if self.pp_virtual_stages < 2:
                problems.append(f"parallel.pp_schedule=interleaved needs parallel."
                                f"pp_virtual_stages >= 2, got {self.pp_virtual_stages}; "
                                "set it to 2 or more (or use pp_schedule=1f1b)")
        elif self.pp_schedule in V_SCHEDULES and self.pp_schedule_csv is None:
            if self.pp_virtual_stages != 2:
                problems.append(f"parallel.pp_schedule={self.pp_schedule} needs exactly 2 chunks "
                                f"per rank, got pp_virtual_stages={self.pp_virtual_stages}; set "
                                "parallel.pp_virtual_stages=2")
        elif self.pp_virtual_stages != 1 and self.pp_schedule_csv is None:
            problems.append(f"parallel.pp_virtual_stages={self.pp_virtual_stages} needs "
                            f"pp_schedule=interleaved (got {self.pp_schedule}); set "
                            "parallel.pp_virtual_stages=1 or pp_schedule=interleaved")
        if self.zero_stage == 3 and (self.pp_schedule in ("zb_h1",) + V_SCHEDULES
                                     or self.pp_schedule_csv is not None):
            problems.append(f"parallel.zero_stage=3 with a split-backward pipeline "
                            f"({self.pp_schedule_csv or self.pp_schedule}) is not modelled; use "
                            "zero_stage 0, 1 or 2, or pp_schedule=1f1b")
        if self.legacy_dp and (self.tp != 1 or self.pp != 1 or self.zero_stage != 0):
            problems.append(f"parallel.legacy_dp=true (nn.DataParallel) works with tp=1, pp=1, "
                            f"zero_stage=0 only, got tp={self.tp}, pp={self.pp}, "
                            f"zero_stage={self.zero_stage}; set legacy_dp=false")
        if self.pp_stage_layers is not None and len(self.pp_stage_layers) != self.num_stages:
            problems.append(f"parallel.pp_stage_layers has {len(self.pp_stage_layers)} entries "
                            f"but pp * pp_virtual_stages = {self.num_stages}; give one layer "
                            "count per (virtual) stage")
        if self.pp_stage_layers is not None and any(
                isinstance(n, bool) or not isinstance(n, int) or n < 1
                for n in self.pp_stage_layers):
            problems.append(f"parallel.pp_stage_layers={list(self.pp_stage_layers)} must hold "
                            "positive integers")
        if self.cp > 1 and self.legacy_dp:
            problems.append(f"parallel.cp={self.cp} with parallel.legacy_dp=true: nn.DataParallel "
                            "splits batches, not sequences; set parallel.cp=1 or legacy_dp=false")
        raise_if(problems)
        self._check_hsdp(problems)
        if self.dp is not None and self.global_batch_size is not None:
            self._check_batch(problems)
        raise_if(problems)
        if self.dp == 1 and self.cp == 1 and self.zero_stage > 0:
            warnings.warn(f"parallel.zero_stage={self.zero_stage} with dp=1 shards over a "
                          "single rank and saves nothing; use zero_stage=0 or dp > 1",
                          ConfigWarning, stacklevel=3)

    def _check_hsdp(self, problems: list[str]) -> None:
        hsdp = self.dp_replicate > 1 or (self.dp_shard is not None and self.dp_shard != self.dp)
        if not hsdp:
            return
        if self.cp > 1:
            problems.append(f"parallel.dp_replicate={self.dp_replicate} (HSDP) with parallel.cp="
                            f"{self.cp} is not modelled (shards over dp_shard x cp); set "
                            "parallel.dp_replicate=1 or parallel.cp=1")
        elif self.zero_stage != 3 or self.legacy_dp:
            problems.append(f"parallel.dp_replicate={self.dp_replicate} (HSDP) shards with "
                            f"FSDP but zero_stage={self.zero_stage}; set parallel.zero_stage=3 "
                            "or parallel.dp_replicate=1")
        elif self.dp is not None and self.dp % self.dp_replicate:
            problems.append(f"parallel.dp_replicate={self.dp_replicate} does not divide "
                            f"dp={self.dp}; use one of "
                            f"{', '.join(str(d) for d in range(1, self.dp + 1) if self.dp % d == 0)}")
        elif self.dp is not None and self.dp_shard is not None \
                and self.dp_replicate * self.dp_shard != self.dp:
            problems.append(f"parallel.dp_replicate * dp_shard = {self.dp_replicate} * "
                            f"{self.dp_shard} = {self.dp_replicate * self.dp_shard} but "
                            f"dp={self.dp}; set parallel.dp_shard={self.dp // self.dp_replicate}"
                            " or null")

    def _check_batch(self, problems: list[str]) -> None:
        per_step = self.micro_batch_size * self.dp
        if self.global_batch_size % per_step:
            lo = (self.global_batch_size // per_step) * per_step or per_step
            problems.append(
                f"parallel.global_batch_size={self.global_batch_size} is not divisible by "
                f"micro_batch_size * dp = {self.micro_batch_size} * {self.dp} = {per_step}; "
                f"use a multiple of {per_step} such as {lo} or {lo + per_step}")
            return
        m = self.num_microbatches
        if self.pp > 1 and self.pp_schedule == "1f1b" and m < self.pp:
            # Megatron's non-interleaved 1F1B warms up min(p - rank - 1, m) micro-batches:
            # with m < p it is a fill and a drain (torch's Schedule1F1B refuses it)
            warnings.warn(
                f"pp_schedule=1f1b with {m} micro-batch(es) per step on pp={self.pp} stages "
                f"degenerates to fill/drain: bubble {(self.pp - 1) / (m + self.pp - 1):.0%} of "
                f"the step; parallel.global_batch_size={self.pp * per_step} or more fills the "
                "pipeline", ConfigWarning, stacklevel=3)
        elif self.pp > 1 and self.pp_schedule == "interleaved" and m < self.pp:
            problems.append(
                f"pp_schedule={self.pp_schedule} needs at least pp={self.pp} micro-batches "
                f"per step, got {m} (global_batch_size={self.global_batch_size} / "
                f"(micro_batch_size={self.micro_batch_size} * dp={self.dp})); set "
                f"parallel.global_batch_size={self.pp * per_step} or more")
        elif self.pp_schedule == "dualpipev" and self.pp_schedule_csv is None \
                and m < 2 * self.pp:
            problems.append(
                f"pp_schedule=dualpipev needs at least 2 * pp = {2 * self.pp} micro-batches per "
                f"step (torch's ScheduleDualPipeV: as many as stages), got {m}; set "
                f"parallel.global_batch_size={2 * self.pp * per_step} or more")
        elif self.pp_schedule == "interleaved" and self.pp > 1 and m % self.pp:
            problems.append(
                f"pp_schedule=interleaved needs the micro-batches per step ({m}) to be a "
                f"multiple of pp={self.pp}; set parallel.global_batch_size to a multiple of "
                f"{self.pp * per_step}")

    @property
    def rank_dims(self) -> tuple[str, ...]:
        """The grid's axes, innermost first, always all of tp, cp, pp, dp."""
        dims = tuple(d.strip() for d in str(self.rank_order).split("-"))
        if sorted(dims) != sorted(RANK_DIMS) and sorted(dims) != sorted(("tp", "pp", "dp")):
            raise ValueError(
                f"parallel.rank_order={self.rank_order!r} must name each of tp, cp, pp, dp "
                "once, innermost first, e.g. 'tp-cp-pp-dp'")
        if "cp" not in dims:
            dims = ("cp",) + dims
        return dims

    @property
    def sync_every_microbatch(self) -> bool:
        """Whether gradients are reduced after every micro-batch (see grad_sync)."""
        if self.grad_sync == "default":
            return self.zero_stage >= 2
        return self.grad_sync == "every"

    @property
    def shard_degree(self) -> int:
        """Ranks a ZeRO/FSDP shard is split over: dp_shard under HSDP, else dp * cp (CP
        ranks hold the same weights, so they shard them too: torchtitan's dp_shard_cp mesh)."""
        if self.dp is None:
            raise ValueError("shard_degree needs dp resolved (use twin.spec.build_job)")
        return (self.dp // self.dp_replicate if self.dp_shard is None else self.dp_shard) * self.cp

    @property
    def expert_tp(self) -> int:
        """etp resolved: the expert tensor-parallel degree (tp when etp is None)."""
        return self.tp if self.etp is None else self.etp

    @property
    def num_stages(self) -> int:
        """Model chunks along the pipeline: pp * pp_virtual_stages."""
        return self.pp * self.pp_virtual_stages

    @property
    def num_microbatches(self) -> int:
        """m = B / (b * dp): micro-batches each pipeline runs per step."""
        if self.dp is None or self.global_batch_size is None:
            raise ValueError("num_microbatches needs dp and global_batch_size resolved "
                             "(use twin.spec.build_job)")
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def world_size(self) -> int:
        """dp * tp * pp * cp."""
        if self.dp is None:
            raise ValueError("world_size needs dp resolved (use twin.spec.build_job)")
        return self.dp * self.tp * self.pp * self.cp


def _check_int(problems: list[str], name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        problems.append(f"parallel.{name}={value!r} must be a positive integer")
