"""Parallelise the conformance model with PyTorch's own APIs, one function per paradigm.

Applied in torchtitan's fixed order: split into pipeline chunks (``pipeline_chunks``),
then tensor parallelism inside each chunk (``apply_tp``), then a MoE model's expert
parallelism (``experts.apply_ep``), then activation checkpointing (``checkpoint.apply_ac``),
then data parallelism over the DP mesh dimension
(``apply_fsdp`` or ``apply_ddp``, which leaves EP-sharded experts to their own sync). The
device mesh is built from the job's RankGrid (``device_mesh``), so PyTorch's groups are the
twin's groups.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from executor.conformance.checkpoint import apply_ac
from twin.spec import ConfigError, Job

MESH_DIMS = ("dp", "pp", "tp")
HSDP_MESH_DIMS = ("dp_replicate", "dp_shard", "pp", "tp")


def check_plan(job: Job) -> None:
    """Raise a ConfigError for plans that have no PyTorch-native counterpart here."""
    p, m = job.parallel, job.model
    problems = []
    if p.legacy_dp:
        problems.append("parallel.legacy_dp=true (nn.DataParallel) drives several devices from one "
                        "process and gloo ranks have one CPU each; use parallel=ddp")
    if p.zero_stage in (1, 2):
        problems.append(f"parallel.zero_stage={p.zero_stage} has no PyTorch-native counterpart "
                        "in conformance (DDP is stage 0, FSDP2 stage 3); use parallel=ddp or "
                        "parallel=fsdp")
    if p.zero_stage == 3 and p.fsdp_reduce_dtype != m.dtype:
        problems.append(f"parallel.fsdp_reduce_dtype={p.fsdp_reduce_dtype} with model.dtype="
                        f"{m.dtype}: conformance's FSDP2 reduces gradients in the model's dtype "
                        f"(no MixedPrecisionPolicy); set parallel.fsdp_reduce_dtype={m.dtype}")
    if p.recompute == "selective":
        problems.append("parallel.recompute=selective (Megatron's attention-core recompute) has "
                        "no PyTorch-native counterpart; conformance checkpoints as torchtitan does: "
                        "set parallel.recompute=op, full (with recompute_early_stop=true) or none")
    if p.recompute == "full" and not p.recompute_early_stop:
        problems.append("parallel.recompute=full recomputes the whole layer (Megatron's), but "
                        "PyTorch's non-reentrant checkpoint, which conformance runs as torchtitan "
                        "does, stops before the last GEMM and its reduction; set parallel."
                        "recompute_early_stop=true")
    if p.pp > 1 and m.tie_embeddings:
        problems.append("model.tie_embeddings=true with parallel.pp > 1: torch.distributed."
                        "pipelining has no shared weights across stages; set tie_embeddings=false")
    if p.pp > 1 and p.zero_stage == 3:
        problems.append("parallel.zero_stage=3 with pp > 1: pipelining defers FSDP2's gradient "
                        "reduction to the last micro-batch, which the schedule does not model yet; "
                        "use zero_stage=0 (DDP) with pipelining")
    if p.pp > 1 and p.pp_schedule == "gpipe" and p.dp > 1 and p.zero_stage == 0:
        problems.append("pp_schedule=gpipe with DDP (dp > 1): torch.distributed.pipelining's "
                        "ScheduleGPipe trips DDP's Reducer in its second step (torch 2.13: 'rebuilt "
                        "parameter indices size is not same as original model parameters size'); "
                        "use pp_schedule=1f1b or interleaved with DDP, or dp=1 with gpipe")
    split = p.pp_schedule in ("zb_h1", "zb_v", "dualpipev") or p.pp_schedule_csv is not None
    if p.pp > 1 and split and p.dp > 1:
        problems.append(f"pp_schedule={p.pp_schedule_csv or p.pp_schedule} with data parallelism "
                        "(dp > 1): torch 2.13's split backward (I/W) with DDP leaves some ranks' "
                        "gradients unreduced (no all-reduce on the last stage; losses off a single "
                        "process by 1e-3 at step 3); use dp=1 with split-backward pipelines")
    rounds = max(1, p.num_microbatches // p.pp)
    if p.pp > 1 and p.pp_schedule == "zb_h1" and p.pp_schedule_csv is None \
            and p.num_microbatches % rounds:
        problems.append(f"pp_schedule=zb_h1 runs as torch's ScheduleInterleavedZeroBubble, which "
                        f"needs the {p.num_microbatches} micro-batches to be a multiple of "
                        f"max(1, m // pp) = {rounds}; set parallel.global_batch_size so that m is "
                        f"a multiple of pp={p.pp}")
    if p.tp > 1 and m.num_kv_heads % p.tp:
        problems.append(f"parallel.tp={p.tp} > model.num_kv_heads={m.num_kv_heads}: ColwiseParallel "
                        "would split a KV head across ranks (the schedule replicates it); use "
                        f"tp <= {m.num_kv_heads} or model.num_kv_heads={p.tp}")
    if p.sp and m.seq_len % p.tp:
        problems.append(f"parallel.sp=true needs tp={p.tp} to divide model.seq_len={m.seq_len}")
    if p.cp > 1 and (p.cp_method != "ring" or p.pp > 1):
        problems.append(f"parallel.cp={p.cp} with cp_method={p.cp_method}, pp={p.pp}: conformance "
                        "runs CP as a plain-PyTorch ring attention (torch's context_parallel needs "
                        "CUDA SDPA kernels) without pipelining; use cp_method=ring and pp=1")
    if m.moe is not None:
        from executor.conformance.experts import plan_problems

        problems += plan_problems(job)
    if problems:
        raise ConfigError(problems)


def device_mesh(job: Job):
    """A (dp, pp, tp) DeviceMesh whose entry [d, p, t] is the grid's rank at those coordinates;
    under HSDP (dp_replicate, dp_shard, pp, tp), dp = replica * dp_shard + shard (torchtitan's
    mesh order, the grid's split of dp)."""
    from torch.distributed.device_mesh import DeviceMesh

    g, p = job.grid, job.parallel
    ranks = torch.tensor([[[g.rank(dp=d, pp=s, tp=t) for t in range(p.tp)] for s in range(p.pp)]
                          for d in range(p.dp)], dtype=torch.int64)
    if p.dp_replicate > 1:
        ranks = ranks.reshape(p.dp_replicate, p.shard_degree, p.pp, p.tp)
        return DeviceMesh("cpu", ranks, mesh_dim_names=HSDP_MESH_DIMS)
    if p.cp > 1:  # (dp, pp, cp, tp), the grid's order outermost first; dp x cp flattened
        ranks = torch.tensor([[[[g.rank(dp=d, pp=s, cp=c, tp=t) for t in range(p.tp)]
                                for c in range(p.cp)] for s in range(p.pp)] for d in range(p.dp)])
        mesh = DeviceMesh("cpu", ranks, mesh_dim_names=("dp", "pp", "cp", "tp"))
        mesh["dp", "cp"]._flatten("dp_cp")
        return mesh
    return DeviceMesh("cpu", ranks, mesh_dim_names=MESH_DIMS)


def chunk_layers(job: Job) -> list[range]:
    """Global layer indices of each of the pp * v model chunks, in pipeline order."""
    starts = [0]
    for n in job.stage_layers:
        starts.append(starts[-1] + n)
    return [range(starts[c], starts[c + 1]) for c in range(job.parallel.num_stages)]


def pipeline_chunks(model: nn.Module, job: Job, stage: int) -> list[tuple[int, nn.Module]]:
    """(chunk index, module) of the chunks pipeline rank ``stage`` holds (``Job.placement``:
    Megatron's c % pp, or the V of zb_v and dualpipev)."""
    p = job.parallel
    if p.pp == 1:
        return [(0, model)]
    layers = chunk_layers(job)
    out = []
    for chunk in (c for c in range(p.num_stages) if job.chunk_stage(c) == stage):
        part = copy.deepcopy(model)
        for key in list(part.layers.keys()):
            if int(key) not in layers[chunk]:
                del part.layers[key]
        if chunk != 0:
            part.embed = None
        if chunk != p.num_stages - 1:
            part.final_norm = None
            part.lm_head = None
        out.append((chunk, part))
    return out


def apply_tp(model: nn.Module, tp_mesh, sp: bool) -> None:
    """Megatron TP with DTensor: vocab-parallel embedding, column-parallel Q/K/V and gate/up,
    row-parallel out-proj and fc2, column-parallel LM head with a vocab-parallel loss.

    Each attention and MLP block takes its input through one PrepareModuleInput, so the
    backward sums Q, K and V's (gate and up's) input gradients before one all-reduce
    (reduce-scatter under SP), like the twin's fused QKV. Under SP the norms run on
    sequence shards (SequenceParallel) and the blocks all-gather their input.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    act = Shard(1) if sp else Replicate()
    top = {}
    if model.embed is not None:
        top["embed"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=act)
    if model.lm_head is not None:
        top["lm_head"] = ColwiseParallel(input_layouts=act, output_layouts=Shard(-1),
                                         use_local_output=False)
        if sp:
            top["final_norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, top)
    if model.embed is not None and model.lm_head is not None and model.spec.tie_embeddings:
        model.lm_head.weight = model.embed.weight  # both Shard(0) over the vocabulary
    for layer in model.layers.values():
        plan = {
            "attn": PrepareModuleInput(input_layouts=(act,), desired_input_layouts=(Replicate(),)),
            "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(),
            "attn.wv": ColwiseParallel(), "attn.wo": RowwiseParallel(output_layouts=act),
            "mlp": PrepareModuleInput(input_layouts=(act,), desired_input_layouts=(Replicate(),)),
            "mlp.w_gate": ColwiseParallel(), "mlp.w_up": ColwiseParallel(),
            "mlp.fc2": RowwiseParallel(output_layouts=act),
        }
        if sp:
            plan.update({"norm1": SequenceParallel(), "norm2": SequenceParallel()})
        parallelize_module(layer, tp_mesh, plan)


def apply_fsdp(model: nn.Module, dp_mesh, reshard_after_forward: bool) -> nn.Module:
    """FSDP2: ``fully_shard`` each layer, then the root (embedding, final norm, head).

    ``reshard_after_forward`` applies to the layers; the root keeps FSDP2's own default.
    """
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers.values():
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    # None: FSDP2's default for the root, which keeps its parameters gathered after forward
    # (backward needs them at once); an explicit True would free and gather them again
    return fully_shard(model, mesh=dp_mesh, reshard_after_forward=None if reshard_after_forward
                       else False)


def apply_ddp(model: nn.Module, dp_mesh, bucket_MB: float, ignore: list[str] = ()) -> nn.Module:
    """DDP over the DP mesh dimension (``device_mesh=``, which also takes DTensor parameters);
    the parameters named in ``ignore`` (EP-sharded experts) are left to their own sync."""
    from torch.nn.parallel import DistributedDataParallel

    if ignore:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, list(ignore))
    return DistributedDataParallel(model, device_mesh=dp_mesh, bucket_cap_mb=bucket_MB,
                                   broadcast_buffers=False)


def apply_cp(model: nn.Module, job: Job, group) -> None:
    """Every layer's attention a ring over ``group`` (executor/conformance/ring.py), rotating
    the positions this rank holds (chunks i and 2cp-1-i, or chunk i)."""
    from executor.conformance.ring import shard

    p = job.parallel
    i = job.grid.coord(torch.distributed.get_rank(), "cp")
    pos = shard(torch.arange(job.model.seq_len), p.cp, i, p.cp_load_balance, dim=0)
    for layer in model.layers.values():
        layer.attn.cp = (group, p.cp_load_balance, pos)


def tp_sharded(model: nn.Module) -> set[str]:
    """Names of the parameters TP split (DTensors with a Shard placement), before DDP
    turns them back into local tensors."""
    from torch.distributed.tensor import DTensor

    return {n for n, q in model.named_parameters()
            if isinstance(q, DTensor) and any(pl.is_shard() for pl in q.placements)}


def parallelize(model: nn.Module, job: Job, mesh) -> list[tuple[int, nn.Module, set[str]]]:
    """This rank's (chunk, module, TP-sharded parameter names), parallel as the plan says."""
    p = job.parallel
    stage = job.grid.coord(torch.distributed.get_rank(), "pp")
    out = []
    for chunk, part in pipeline_chunks(model, job, stage):
        if p.tp > 1:
            apply_tp(part, mesh["tp"], p.sp)
        sharded = tp_sharded(part)
        ignore: list[str] = []
        if job.model.moe is not None:  # expert parallelism, before DDP (which skips experts)
            from executor.conformance.experts import apply_ep, expert_params

            if apply_ep(part, job) is not None:
                ignore = [n for n, _ in expert_params(part)]
        if p.cp > 1:  # attention as a ring over the CP group, on the positions held here
            apply_cp(part, job, mesh["cp"].get_group())
        apply_ac(part, p.recompute)  # after TP, before data parallelism (torchtitan's order)
        dp_name = "dp_cp" if p.cp > 1 else "dp"  # gradients over dp x cp (the schedule's dp-cp)
        if p.dp * p.cp > 1 and p.zero_stage == 3:
            dp_mesh = mesh["dp_replicate", "dp_shard"] if p.dp_replicate > 1 else mesh[dp_name]
            part = apply_fsdp(part, dp_mesh, p.fsdp_reshard_after_forward)
        elif p.dp * p.cp > 1:
            part = apply_ddp(part, mesh[dp_name], p.ddp_bucket_MB, ignore)
        out.append((chunk, part, sharded))
    return out
