"""Memory per rank by category: model states (per ZeRO stage) and activations (Korthikanti).

Model states: Rajbhandari et al. 2020 (ZeRO), §3.1 and §5: mixed-precision Adam keeps
2 bytes of params, 2 of grads and K = 12 of optimizer state (fp32 master, momentum,
variance) per parameter: 16*Psi replicated; ZeRO-1 4*Psi + K*Psi/Nd; ZeRO-2
2*Psi + (2+K)*Psi/Nd; ZeRO-3 (2+2+K)*Psi/Nd. Pure fp32 training keeps 4 + 4 + 8.

Activations: Korthikanti et al. 2022, §4 and Table 2, generalised term by term to
GQA, SwiGLU, RMSNorm and models without dropout; for MHA, f = 4h, GPT style and
2-byte activations it reduces exactly to sbh(34 + 5as/h) and its TP/SP/recompute rows.

What the static tensors leave out, as named categories (zero on a CPU cluster: no CUDA, no
NCCL): ``temporary`` (the largest kernel's transient buffers: the fp32 cross-entropy over
the vocabulary, eager attention's s x s scores, a recomputed layer), ``workspace`` (cuBLAS
and cuBLASLt workspaces), ``allocator_reserve`` (the caching allocator's reserved but
unallocated bytes), ``comm_buffers`` (NCCL's per-channel connection buffers of every
communicator the rank uses) and ``cuda_context``. ``Memory.reserved`` is what
``torch.cuda.max_memory_reserved()`` reports; ``Memory.total`` adds what lives outside
PyTorch's allocator (NCCL, the context): the device memory the fit check holds against HBM.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from twin.schedule.tables import held_layer_bytes
from twin.schedule.tables import inflight as table_inflight
from twin.spec import ClusterSpec, Job, ModelSpec
from twin.spec.parallel import OPTIMIZER_STATE_BYTES
from twin.workload import context as cp  # context parallelism: s/cp tokens, KV buffers
from twin.workload.comm import step_traffic
from twin.workload.loss import (  # noqa: F401 - loss_temporary_bytes: public here
    compiled_loss,
    loss_temporary_bytes,
    saved_logits_bytes,
)
from twin.workload.moememory import moe_memory_delta
from twin.workload.params import (
    embedding_tensors,
    fsdp_layer_units,
    kv_heads_per_rank,
    layer_tensors,
    stage_params,
)

# (params, grads, optimizer) bytes per parameter; mixed precision Adam has K = 12.
STATE_BYTES = {"bf16": (2, 2, 12), "fp16": (2, 2, 12), "fp32": (4, 4, 8)}


@dataclass(frozen=True)
class Memory:
    """Bytes held by one rank at its peak, by category."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    buffers: float = 0.0
    """Transient communication buffers: ZeRO-3/FSDP gathered units, legacy-DP gathered outputs."""
    temporary: float = 0.0
    """The largest kernel's transient buffers at the peak (``temporary_bytes``)."""
    workspace: float = 0.0
    """cuBLAS and cuBLASLt workspaces, from the caching allocator (``workspace_bytes``)."""
    allocator_reserve: float = 0.0
    """Reserved by the caching allocator but not allocated (``allocator_reserve_bytes``)."""
    comm_buffers: float = 0.0
    """NCCL's connection buffers, allocated by NCCL outside PyTorch (``comm_buffer_bytes``)."""
    cuda_context: float = 0.0
    """The CUDA context: driver state and loaded kernels, outside PyTorch (``CUDA_CONTEXT_BYTES``)."""

    @property
    def total(self) -> float:
        """Device memory in use at the peak (what nvidia-smi shows; the fit check's figure)."""
        return sum(getattr(self, f.name) for f in fields(self))

    @property
    def tensors(self) -> float:
        """Model states, activations and buffers: what the schedule's alloc/free ops hold."""
        return self.params + self.grads + self.optimizer + self.activations + self.buffers

    @property
    def allocated(self) -> float:
        """Peak bytes in live tensors: ``torch.cuda.max_memory_allocated()``."""
        return self.tensors + self.temporary + self.workspace

    @property
    def reserved(self) -> float:
        """Peak bytes the caching allocator holds: ``torch.cuda.max_memory_reserved()``."""
        return self.allocated + self.allocator_reserve

    def as_dict(self) -> dict[str, float]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["total"] = self.total
        return out


def model_state_bytes(psi: float, dp: int, zero_stage: int, dtype: str = "bf16",
                      optimizer_dtype: str = "fp32") -> Memory:
    """Params, grads and optimizer states of Psi parameters on one of Nd = dp ranks (ZeRO §5);
    with bf16 momentum and variance the optimizer holds 4 B less per parameter."""
    p, g, o = (b * psi for b in STATE_BYTES[dtype])
    o -= 2 * (4 - OPTIMIZER_STATE_BYTES[optimizer_dtype]) * psi
    return Memory(params=p / dp if zero_stage >= 3 else p,
                  grads=g / dp if zero_stage >= 2 else g,
                  optimizer=o / dp if zero_stage >= 1 else o)


def activation_bytes_per_layer(model: ModelSpec, batch: int, tp: int = 1, sp: bool = False,
                               recompute: str = "none", flash_attention: bool = False) -> float:
    """Bytes one layer keeps for backward for one micro-batch on one TP rank.

    Korthikanti Table 2 (2-byte activations, 1-byte dropout masks):
      no parallelism       sbh(34 + 5as/h)
      TP                   sbh(10 + 24/t + 5as/(ht))
      TP + SP              sbh(34/t + 5as/(ht))
      TP + selective       sbh(10 + 24/t);  TP + SP + selective  34sbh/t
      full recompute       2sbh (the layer input; 2sbh/t under SP, where the input is sharded)
    The 10sbh left whole by TP are the norm inputs, the QKV and FC1 inputs and the
    dropout masks; SP splits them along the sequence. Flash attention keeps no s x s
    scores (like selective) but an fp32 log-sum-exp per query and head.

    ``recompute="op"`` is torchtitan's op-level selective checkpointing (its
    ``_save_list`` policy, parallelize_llama.py): the block's input, the output of every
    other matmul in forward order (the 1st, 3rd, ...: column shards under TP, the down
    projection's row-parallel partial sum whole), the fused attention's output (with its
    fp32 log-sum-exp) and, under SP, the two reduce-scatters' outputs are kept; everything
    else is recomputed in backward.
    """
    s, b, h, e = model.seq_len, batch, model.hidden_size, model.dtype_bytes
    sbh = s * b * h
    rep_div = tp if sp else 1
    if recompute == "full":
        return e * sbh / rep_div
    heads = model.num_heads // tp
    kv = kv_heads_per_rank(model, tp) * model.head_dim
    f_local = model.ffn_hidden_size // tp
    if recompute == "op":
        q = heads * model.head_dim
        mlp = [f_local, f_local, h] if model.activation == "swiglu" else [f_local, h]
        saved = sum([q, kv, kv, h, *mlp][0::2])  # matmul outputs per token, every other one
        attn = e * q + 4 * heads if flash_attention else 0  # fused attention output + LSE
        scattered = 2 * e * sbh / tp if sp else 0  # the reduce-scatters' outputs
        return e * sbh / rep_div + s * b * (e * saved + attn) + scattered
    mask = 1 if model.dropout else 0
    # Whole under TP (split under SP): 2 norm inputs, QKV and FC1 inputs, 2 dropout masks.
    replicated = 4 * e * sbh + 2 * mask * sbh
    # Split by TP: Q, K, V, out-proj input, MLP intermediates.
    split = e * s * b * (heads * model.head_dim + 2 * kv + heads * model.head_dim)
    mlp_tensors = 3 if model.activation == "swiglu" else 2  # gate, up, product | act in, fc2 in
    split += mlp_tensors * e * s * b * f_local
    # Attention core: softmax output, dropout mask and dropout output (as^2 b each).
    if flash_attention or recompute == "selective":
        core = 4 * s * b * heads if flash_attention and recompute != "selective" else 0
    else:
        core = (e + (mask + e) * (1 if model.dropout else 0)) * heads * s * s * b
    return replicated / rep_div + split + core


def inflight_microbatches(job: Job, stage: int) -> float:
    """Micro-batches whose activations a pipeline rank holds at its peak, in units of
    its whole layer count.

    GPipe: all m; 1F1B: min(m, p - i) (Narayanan §2.2.1); interleaved: Megatron's
    warm-up 2(p - i - 1) + (v - 1)p plus one, in chunks of 1/v of the stage, which on
    stage 0 gives Korthikanti's p(1 + (p-1)/(p v)). Without pipelining, one. Split
    backward, CSV tables: walked on the table (twin.schedule.tables.inflight)."""
    p, m, v = job.parallel.pp, job.parallel.num_microbatches, job.parallel.pp_virtual_stages
    if p == 1:
        return 1.0
    if (walked := table_inflight(job, stage)) is not None:
        return walked[0]
    if job.parallel.pp_schedule == "gpipe":
        return float(m)
    if job.parallel.pp_schedule == "1f1b":
        return float(min(m, p - stage))
    chunks = min(m * v, 2 * (p - stage - 1) + (v - 1) * p + 1)
    return chunks / v


def rank_memory(job: Job, rank: int, recompute: str | None = None) -> Memory:
    """Peak memory of one rank by category: the tensors (model states, activations,
    buffers), the largest transient, and on a GPU the workspaces, the allocator's reserve,
    NCCL's buffers and the CUDA context.

    ``recompute`` overrides the plan's policy (``"op"``: torchtitan's op-level selective
    checkpointing, as ``parallel.recompute=op``).
    """
    recompute = recompute or job.parallel.recompute
    mem = _tensor_memory(job, rank, recompute)
    temporary = temporary_bytes(job, rank, recompute)
    if not on_gpu(job.cluster):
        return replace(mem, temporary=temporary)
    workspace = workspace_bytes(job.cluster)
    allocated = mem.tensors + temporary + workspace
    return replace(mem, temporary=temporary, workspace=workspace,
                   allocator_reserve=allocator_reserve_bytes(
                       allocated, live_tensor_count(job, rank, recompute)),
                   comm_buffers=comm_buffer_bytes(job, rank), cuda_context=CUDA_CONTEXT_BYTES)


def _tensor_memory(job: Job, rank: int, recompute: str) -> Memory:
    """Model states, activations and buffers of one rank at its peak (under CP the activations
    of s/cp tokens, plus the attention's KV buffers: twin.workload.context)."""
    model, par = cp.local_model(job.model, job.parallel), job.parallel
    stage = job.grid.coord(rank, "pp")
    psi = stage_params(job, stage)
    e = model.dtype_bytes
    if par.legacy_dp:
        return _legacy_dp_memory(job, rank, psi, recompute)
    states = model_state_bytes(psi, par.shard_degree, par.zero_stage, model.dtype,
                               par.optimizer_dtype)
    b, s = par.micro_batch_size, model.seq_len
    per_layer = activation_bytes_per_layer(model, b, par.tp, par.sp, recompute,
                                           par.flash_attention)
    n_layers = len(job.layers_on_stage(stage))
    inflight = inflight_microbatches(job, stage)
    acts = per_layer * n_layers * inflight
    if recompute == "full" and par.pp > 1 and table_inflight(job, stage) is not None:  # I to W
        acts = held_layer_bytes(job, stage, per_layer, activation_bytes_per_layer(
            model, b, par.tp, par.sp, "none", par.flash_attention))
    sp_div = par.tp if par.sp else 1
    if stage == 0 and model.dropout:
        acts += s * b * model.hidden_size / sp_div * max(1.0, inflight)  # embedding dropout mask
    if stage == job.head_stage:
        # final norm input, LM head input, fp32 logits (Korthikanti §4.3): one micro-batch
        # in flight on the last stage, except under GPipe (all m) and tables walked
        head_inflight = par.num_microbatches if par.pp > 1 and par.pp_schedule == "gpipe" else 1
        head_inflight = (table_inflight(job, stage) or (0, head_inflight))[1] if par.pp > 1 else 1
        acts += head_inflight * (2 * e * s * b * model.hidden_size / sp_div
                                 + saved_logits_bytes(model, par, b))
    buffers = cp.buffer_bytes(job.model, par)
    if par.zero_stage == 3 and par.dp * par.cp > 1:
        # FSDP units: the root (embedding, head) stays gathered from its first forward to its
        # backward, with its unsharded gradient; layer units: the current one and the
        # prefetched one (every unit when not resharded after forward) plus one unsharded
        # grad; without a sync every micro-batch, every unit's unsharded grad is kept, and
        # FSDP2 accumulates it in its reduce dtype (_fsdp_param_group.py: "an accumulated
        # gradient of the reduce dtype"): parallel.fsdp_reduce_dtype, fp32 by default
        units = fsdp_layer_units(job, stage)
        unit, layers = max(units, default=0), sum(units)
        root = psi - layers
        gathered = 2 * unit if par.fsdp_reshard_after_forward else layers
        buffers += (2 * root + gathered + unit) * e
        if not par.sync_every_microbatch and par.num_microbatches > 1:
            buffers += (root + layers) * job.fsdp_reduce_bytes - (root + unit) * e
    moe = moe_memory_delta(job, rank, recompute, inflight_microbatches(job, stage),
                           model_state_bytes)  # MoE layers' experts, routed activations
    return Memory(params=states.params + moe["params"], grads=states.grads + moe["grads"],
                  optimizer=states.optimizer + moe["optimizer"],
                  activations=acts + moe["activations"], buffers=buffers + moe["buffers"])


def _legacy_dp_memory(job: Job, rank: int, psi: int, recompute: str) -> Memory:
    """nn.DataParallel: device 0 holds the optimizer, the reduced grads and every
    replica's gathered output (fp32 logits); the others hold a replica's params,
    grads and activations (mission seed 000: device 0 does more work)."""
    model, par = job.model, job.parallel
    p, g, o = (x * psi for x in STATE_BYTES[model.dtype])
    b, s = par.micro_batch_size, model.seq_len
    per_layer = activation_bytes_per_layer(model, b, 1, False, recompute,
                                           par.flash_attention)
    acts = per_layer * model.num_layers + 4 * s * b * model.vocab_size
    if rank == 0:
        gathered = 4 * s * b * model.vocab_size * par.dp
        return Memory(params=p, grads=g, optimizer=o, activations=acts, buffers=gathered)
    return Memory(params=p, grads=g, optimizer=0.0, activations=acts)


# --- What the static tensors leave out -------------------------------------------------

MIB = 2 ** 20
NCCL_SIMPLE_BUFF_BYTES = 4 * MIB
"""NCCL_BUFFSIZE, the Simple protocol's buffer per connection (NCCL src/init.cc DEFAULT_BUFFSIZE)."""
NCCL_LL128_BUFF_BYTES = 120 * 640 * 8 * 8
"""DEFAULT_LL128_BUFFSIZE: 120 elements x 640 threads x NCCL_STEPS 8 x 8 bytes (4.69 MiB)."""
NCCL_LL_BUFF_BYTES = 8 * 512 * 8 * 16
"""DEFAULT_LL_BUFFSIZE: 8 lines x 512 threads x NCCL_STEPS 8 x 16-byte lines (512 KiB)."""
NCCL_CONNECTION_BYTES = NCCL_SIMPLE_BUFF_BYTES + NCCL_LL128_BUFF_BYTES + NCCL_LL_BUFF_BYTES
NCCL_CHANNELS = 16
"""Channels of one collective communicator (NCCL picks them from the topology: 8-32 on
NVLink nodes, capped by NCCL_MAX_NCHANNELS; 16 assumed)."""
NCCL_P2P_CHANNELS_PER_PEER = 2
"""NCCL's default p2p channels per peer (its "2 p2p channels per peer" init line)."""
CUDA_CONTEXT_BYTES = 400 * MIB
"""CUDA >= 11.7 with lazy module loading, PyTorch's default: "around 400MB" (ptrblck,
pytorch/pytorch#109888; 287 MB for a tiny program, 667 MB without lazy loading: #86509)."""
FRAGMENTATION = 0.15
"""(reserved - allocated) / reserved of the caching allocator: GMLake (Guo et al., ASPLOS
2024, abstract) measured 15% on average (up to 33%) over eight LLMs on A100-80GB."""
ROUND_WASTE_BYTES = 1 * MIB
"""A large segment is cudaMalloc'd in 2 MiB multiples and a remainder under 1 MiB
(kSmallSize) is not split off (c10/cuda/CUDACachingAllocator.cpp): ~1 MiB per segment."""
SAVED_TENSORS_PER_LAYER = {"none": 12, "selective": 10, "op": 6, "full": 1}
"""About how many separate tensors one layer keeps for backward, per policy."""


def on_gpu(cluster: ClusterSpec) -> bool:
    """CUDA devices (NCCL, cuBLAS, a caching allocator); ``shared_cpu`` ranks have none."""
    return cluster.intra.kind != "shared_cpu"


def workspace_bytes(cluster: ClusterSpec) -> float:
    """cuBLAS and cuBLASLt workspaces on the compute stream: 32 MiB each on Hopper and
    later, 4 MiB before (cuBLAS docs, cublasSetWorkspace; PyTorch #120925)."""
    name = cluster.gpu.name.upper()
    hopper_or_later = name.startswith(("H1", "H2", "H8", "GH", "B1", "B2", "B3", "GB"))
    return 2 * (32 if hopper_or_later else 4) * MIB


def comm_buffer_bytes(job: Job, rank: int) -> float:
    """NCCL buffers of the communicators ``rank`` uses (the groups it moves bytes in).

    Per connection one buffer per protocol (Simple NCCL_BUFFSIZE 4 MiB, LL128 4.69 MiB,
    LL 512 KiB); a collective communicator connects each rank to its ring neighbours on
    every channel, one buffer set per channel; pipeline send/recv uses
    ``NCCL_P2P_CHANNELS_PER_PEER`` channels to each neighbouring stage.
    """
    par = job.parallel
    total = 0.0
    for name, g in step_traffic(job, rank).items():
        if g.size < 2:
            continue
        if name == "pp":
            stage = job.grid.coord(rank, "pp")
            ends = par.pp_schedule != "interleaved" and stage in (0, par.pp - 1)
            peers = 1 if par.pp == 2 or ends else 2
            total += peers * NCCL_P2P_CHANNELS_PER_PEER * NCCL_CONNECTION_BYTES
        elif name == "cp" and par.cp_method == "ring":  # send/recv to the ring's neighbours
            total += min(2, par.cp - 1) * NCCL_P2P_CHANNELS_PER_PEER * NCCL_CONNECTION_BYTES
        else:
            total += NCCL_CHANNELS * NCCL_CONNECTION_BYTES
    return total


def layer_temporary_bytes(model: ModelSpec, batch: int, tp: int = 1, sp: bool = False,
                          recompute: str = "none", flash_attention: bool = False) -> float:
    """One layer's transient in its backward: what recomputation re-creates (the layer's
    activations less those kept) plus the attention backward's own buffers: eager, the
    gradients of the probabilities and of the scores, 2e b (a/t) s^2; flash, the fp32
    dQ accumulator 4 s b (a/t) d (FlashAttention-2 backward)."""
    kept = activation_bytes_per_layer(model, batch, tp, sp, recompute, flash_attention)
    full = activation_bytes_per_layer(model, batch, tp, sp, "none", flash_attention)
    s, heads = model.seq_len, model.num_heads // tp
    if flash_attention:
        attention = 4 * s * batch * heads * model.head_dim
    else:
        attention = 2 * model.dtype_bytes * batch * heads * s * s
    return max(full - kept, 0.0) + attention


def temporary_bytes(job: Job, rank: int, recompute: str | None = None) -> float:
    """The largest transient at the rank's peak: one layer's backward (every stage) or the
    loss (the last stage), whichever is larger; both come when nearly every activation is
    still held (end of forward, start of backward)."""
    model, par = cp.local_model(job.model, job.parallel), job.parallel
    recompute = recompute or par.recompute
    b = par.micro_batch_size
    tp, sp = (1, False) if par.legacy_dp else (par.tp, par.sp)
    out = layer_temporary_bytes(model, b, tp, sp, recompute, par.flash_attention)
    if job.grid.coord(rank, "pp") == job.head_stage:
        out = max(out, loss_temporary_bytes(model, b, tp, compiled_loss(job.parallel)))
    return out


def live_tensor_count(job: Job, rank: int, recompute: str | None = None) -> float:
    """Separate tensors alive at the peak: per parameter its shard, gradient and Adam's two
    moments (plus an fp32 master copy without ZeRO-3), and the activations kept per layer."""
    model, par = job.model, job.parallel
    stage = job.grid.coord(rank, "pp")
    n_layers = len(job.layers_on_stage(stage))
    params = len(layer_tensors(model, par.tp)) * n_layers + 2 * len(embedding_tensors(model, par.tp))
    copies = 4 if par.zero_stage == 3 else 5
    acts = SAVED_TENSORS_PER_LAYER[recompute or par.recompute] * n_layers \
        * inflight_microbatches(job, stage)
    return params * copies + acts


def allocator_reserve_bytes(allocated: float, live_tensors: float = 0.0) -> float:
    """Reserved but unallocated bytes of PyTorch's caching allocator at the peak.

    At least the rounding of its segments (``ROUND_WASTE_BYTES`` per live tensor); in
    training, fragmentation dominates: blocks split for one size cannot serve a larger
    request, so the reserve grows to f/(1 - f) of what is allocated, f = ``FRAGMENTATION``
    (GMLake's measured mean).
    """
    return max(live_tensors * ROUND_WASTE_BYTES, FRAGMENTATION / (1 - FRAGMENTATION) * allocated)
