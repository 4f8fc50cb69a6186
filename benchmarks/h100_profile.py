"""Derive the DGX H100 and DGX H200 cost profiles from published measurements (issue 13 item 5).

Every parameter of conf/profiles/dgx_h100.yaml and dgx_h200.yaml comes from FIGURES below (a
cited, published H100/H200 measurement) by the arithmetic in ``derive``; where no H100 figure
exists the parameter is an ASSUMPTION and says so. Nothing is copied from the A100 fit but the
host's cost per op (a property of the host and the framework, not of the GPU it drives).

    python benchmarks/h100_profile.py            # derive, print the table and the MFU checks
    python benchmarks/h100_profile.py --write    # also write the two YAML profiles

It then simulates the default job (`paratwin simulate`: Llama-3 8B, FSDP, one DGX H100,
calibration=auto) and published torchtitan H100 runs, measured vs predicted. About 15 s.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from twin.calibrate.fit import KernelPoint, fit_kernel, fit_latency_bandwidth  # noqa: E402
from twin.cost import CostModel, KernelCost, LinkCost  # noqa: E402

PEAK_BF16 = 989.0  # TFLOP/s dense, H100/H200 SXM (published.md §6; torchtitan get_peak_flops)
PEAK_FP8 = 1979.0  # TFLOP/s dense FP8, H100/H200 SXM (the MAMF table's 'Theory')
HBM_GBPS = {"h100": 3350.0, "h200": 4800.0}  # datasheet (published.md §6)
NVLINK_GBPS, NDR_GBPS = 450.0, 50.0  # per direction: NVLink 4 line rate; NDR 400 Gb/s
N_NODE = 8

# -- the cited figures ---------------------------------------------------------------------
AZURE_H100 = ("samuel-bohman/AI-benchmarking-guide, Azure_Results/ND_H100_v5_results.md "
              "(commit a6533f14; 8x H100 80GB HBM3 SXM, Xeon 8480C, CUDA 12.6, NCCL 2.18.5)")
AZURE_H200 = ("samuel-bohman/AI-benchmarking-guide, Azure_Results/ND_H200_v5_results.md "
              "(8x H200 141GB, Xeon 8480C, CUDA 12.6, NCCL 2.20.5)")
MAMF = ("stas00/ml-engineering compute/accelerator/README.md, 'Maximum Achievable Matmul FLOPS "
        "comparison table' (BF16, H100 SXM, torch 2.7.0+cu126; 'H200 is the same')")
MSMF = ("stas00/ml-engineering compute/accelerator/benchmarks/README.md, 'What we measured: "
        "alone vs all-8 concurrent' (H200 bf16, torch 2.14.0.dev20260810+cu130, mamf-finder "
        "--search auto on all 8 GPUs x 5 rounds, n=40): MSMF (sustained, power-saturated) mean "
        "698.6 TFLOP/s at 1405-1527 MHz against MAMF (boost burst) mean 823.9")
MAMF_FP8 = ("stas00/ml-engineering compute/accelerator/README.md, 'Maximum Achievable Matmul "
            "FLOPS comparison table' (FP8 float8_e4m3fn, H100 SXM, torch 2.7.0+cu126)")
FA3 = ("Shah et al. 2024, FlashAttention-3, arXiv:2407.08608, Fig. 5 (forward, causal, head dim "
       "128) and Fig. 6 (backward, head dim 128), FlashAttention-2 bars on H100 80GB SXM5; "
       "16k tokens per batch, hidden 2048 (values as transcribed by subtext.edge.nugit.net "
       "[SECONDARY])")
FIGURES = {
    "gemm_mamf_tflops": (794.5, MAMF),
    # a GEMM sustained at the 700 W power limit runs at the saturated clock, not the boost
    # clock MAMF measures: MSMF over MAMF of the same protocol (H200: the same compute, TDP)
    "gemm_msmf_over_mamf": ((698.6, 823.9), MSMF),
    "gemm_fp8_mamf_tflops": (1402.6, MAMF_FP8),
    # torch.compile's LayerNorm/RMSNorm kernels against Quack's (SOTA CuteDSL) on H100, before
    # Inductor's reduction tuning: the torch of torchtitan's Dec 2024 runs
    "compiled_norm_vs_sota": (0.5, "PyTorch blog 'SOTA Normalization Performance with "
                                   "torch.compile' (Zhang et al.): 'torch.compile ~50% of Quack "
                                   "performance typically' before its fixes"),
    # FlashAttention-2 (PyTorch SDPA's flash backend) on H100 SXM5, TFLOP/s by sequence length
    "fa2_fwd_causal_tflops": ({512: 191, 1024: 260, 2048: 298, 4096: 319, 8192: 333,
                               16384: 335}, FA3),
    "fa2_bwd_tflops": ({512: 214, 1024: 260, 2048: 291, 4096: 310, 8192: 318, 16384: 322}, FA3),
    "fa2_azure_h100_tflops": (327.9, AZURE_H100 + " 'Flash Attention 2.0', d=128, b=2, s=8192"),
    "fa2_azure_h200_tflops": (329.3, AZURE_H200 + " 'Flash Attention 2.0', d=128, b=2, s=8192"),
    "hbm_copy_h100_TBps": (2.90, AZURE_H100 + " 'HBM Bandwidth', Copy (STREAM)"),
    "hbm_copy_h200_TBps": (4.01, AZURE_H200 + " 'HBM Bandwidth', Copy (STREAM)"),
    # NCCL all_reduce (NVLS), 8 GPUs, in-place busbw GB/s by message size 2^10 .. 2^33 bytes
    "allreduce_busbw_h100": ([0.07, 0.14, 0.27, 0.53, 0.95, 1.71, 2.72, 5.40, 10.86, 21.35, 43.70,
                              81.93, 128.73, 172.13, 234.45, 295.53, 361.78, 400.61, 423.38,
                              438.46, 466.35, 472.36, 475.54, 478.87],
                             AZURE_H100 + " 'NCCL Bandwidth' table (1K..8G)"),
    "allreduce_busbw_h200": ([0.06, 0.12, 0.23, 0.47, 0.93, 1.84, 3.72, 7.39, 14.75, 29.38, 52.96,
                              88.78, 138.44, 181.94, 240.41, 300.91, 368.11, 412.45, 432.24,
                              442.72, 467.58, 472.57, 477.41, 479.98],
                             AZURE_H200 + " 'NCCL Bandwidth' table (1K..8G)"),
    # large-message all_reduce busbw vs GPUs in the node: ring ~370 for 2-4, NVLS 420..480 at 5..8
    "allreduce_busbw_by_n": ({2: 370, 3: 370, 4: 370, 5: 420, 6: 440, 7: 460, 8: 480},
                             "user measurements, NVIDIA/nccl#1455 (8x H100; published.md §5.2)"),
    "reduce_scatter_busbw": (360.0, "H100 nccl-tests, NVIDIA/nccl#1281 (pkuleo; jbachan, NVIDIA)"),
    "all_gather_busbw": (350.0, "H100 nccl-tests, NVIDIA/nccl#1281 (pkuleo; jbachan, NVIDIA)"),
    "nvlink_ring_busbw": (370.0, "sjeaugey (NVIDIA), NVIDIA/nccl-tests#212: ring ~370 of 450 GB/s"),
    "ndr_nic_GBps": (47.0, "AddyLaddy (NVIDIA), NVIDIA/nccl-tests#290: 46-48 GB/s per NDR NIC"),
    "nccl_ring_ll_lat_us": ((6.6, 0.6), "NCCL tuning.cc baseLat Ring/LL 6.6 us + hwLat NVLink "
                                        "Ring/LL 0.6 us per step (published.md §5.3)"),
    # compute beside NCCL kernels, against the same compute alone: GPT and LLaMA layers on 4
    # A100s, H100s, MI250s and MI210s (the average; up to 40.0%)
    "overlap_slowdown": (0.189, "Lee et al. 2025, 'Characterizing Compute-Communication "
                                "Overlap in GPU-Accelerated Distributed Deep Learning', "
                                "arXiv:2507.03114, abstract: 'an average computational "
                                "slowdown of 18.9%, with a maximum of 40.0%'"),
}

# -- eager PyTorch's HBM traffic against the twin's fused byte counts ------------------------
# The twin's elementwise ops carry the bytes of a fused kernel (read inputs, write output once).
# Eager PyTorch, as in torchtitan's Llama (torchtitan/models/llama3/model.py: RMSNorm, RoPE
# via view_as_complex, repeat_kv for GQA, SwiGLU) and PyTorch's composite rms_norm
# (aten/src/ATen/native/layer_norm.cpp: upcast, pow, mean, rsqrt, mul, cast, mul weight), runs
# one kernel per op, each reading its inputs and writing its output to HBM. Bytes per token,
# E = hidden, Q = query width, K = key/value width, F = ffn, V = vocabulary (bf16 = 2 B,
# fp32 = 4 B). ASSUMPTION: each op's autograd backward moves twice its forward traffic unless
# counted below. These counts are this script's, not a published measurement.
EAGER = {  # name: (forward bytes per token, backward bytes per token), as functions of dims
    "rmsnorm": (lambda d: 36 * d["E"], lambda d: 72 * d["E"]),   # x2 per layer
    "residual": (lambda d: 6 * d["E"], lambda d: 6 * d["E"]),    # x2 per layer
    "swiglu": (lambda d: 10 * d["F"], lambda d: 22 * d["F"]),    # silu, mul; bwd: 3 muls, silu'
    "rope": (lambda d: 28 * (d["Q"] + d["K"]), lambda d: 28 * (d["Q"] + d["K"])),
    "repeat_kv": (lambda d: 2 * (2 * d["K"] + 2 * d["Q"]), lambda d: 2 * (2 * d["Q"] + 2 * d["K"])),
    "attn_out_transpose": (lambda d: 4 * d["Q"], lambda d: 4 * d["Q"]),
    "cross_entropy": (lambda d: 18 * d["V"], lambda d: 22 * d["V"]),  # fp32 upcast, log_softmax
}
PER_LAYER = {"rmsnorm": 2, "residual": 2, "swiglu": 1, "rope": 1, "repeat_kv": 1,
             "attn_out_transpose": 1}
ADAMW_FUSED_BYTES = 28  # per fp32 param, torch.optim.AdamW(fused=True), torchtitan's default
# (job_config Optimizer.implementation = "fused"): one pass reads param, grad, exp_avg and
# exp_avg_sq (4 x 4 B) and writes param, exp_avg and exp_avg_sq (3 x 4 B). (foreach would be
# 80: mul_(1-lr*wd) 8, lerp_ 12, mul_ 8, addcmul_ 12, sqrt 8, div_ 8, add_ 8, addcdiv_ 16)


def default_job(overrides=()):
    from hydra import compose, initialize_config_dir

    from paratwin.config import CONF_DIR, job_from_cfg, register_schemas
    register_schemas()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="simulate", overrides=list(overrides))
    return job_from_cfg(cfg)


def eager_inflation(job) -> tuple[float, float]:
    """(eager / modelled) bytes of the step's elementwise ops and of the optimizer step."""
    from twin.schedule.builder import build_schedule
    m = job.model
    d = {"E": m.hidden_size, "Q": m.num_heads * m.head_dim, "K": m.num_kv_heads * m.head_dim,
         "F": m.ffn_hidden_size, "V": m.vocab_size}
    tokens = job.parallel.micro_batch_size * m.seq_len
    ops = build_schedule(job).program(0).ops
    layer_ops = [op for op in ops if op.kind == "elementwise" and op.phase != "opt"  # not the clip
                 and not op.one_kernel]  # nor one-kernel ops (FSDP2's copies): no eager factor
    modelled = sum(op.bytes for op in layer_ops)
    mbs = len({op.mb for op in layer_ops})
    eager = 0.0
    for name, (fwd, bwd) in EAGER.items():
        count = m.num_layers * PER_LAYER[name] if name in PER_LAYER else 1
        eager += count * (fwd(d) + bwd(d)) * tokens * mbs
    # the final norm; the embedding (a gather, the same bytes eager and fused)
    eager += (EAGER["rmsnorm"][0](d) + EAGER["rmsnorm"][1](d)) * tokens * mbs
    eager += sum(op.bytes for op in ops if op.kind == "elementwise" and "embed" in op.name)
    opt = [op for op in ops if op.kind == "optimizer"]
    opt_ratio = ADAMW_FUSED_BYTES * opt[0].shape[0] / opt[0].bytes if opt else 1.0
    return eager / modelled, opt_ratio


def attention_fit():
    """FlashAttention-2 (H100) forward-causal and backward points -> efficiency, launch."""
    b_h, d = 16, 128  # FA3 paper: 16k tokens per batch, hidden 2048 -> 16 heads of 128
    pts = []
    for key, mult, causal in (("fa2_fwd_causal_tflops", 1.0, True), ("fa2_bwd_tflops", 2.5, False)):
        for s, tf in FIGURES[key][0].items():
            b = 16384 // s
            flops = 4 * b * b_h * s * s * d * mult * (0.5 if causal else 1.0)
            pts.append(KernelPoint(flops=flops, bytes=0.0, time_s=flops / (tf * 1e12)))
    return fit_kernel(pts, PEAK_BF16 * 1e12, 1e18, start=KernelCost(efficiency=0.3),
                      fit_memory=False)


def allreduce_fit(busbw: list[float]):
    """t = alpha + S / algbw over the nccl-tests table (all_reduce: algbw = busbw * n/(2(n-1)))."""
    sizes = [2.0 ** (10 + i) for i in range(len(busbw))]
    times = [s / (b * 1e9 * N_NODE / (2 * (N_NODE - 1))) for s, b in zip(sizes, busbw)]
    fit = fit_latency_bandwidth(sizes, times)
    return fit.params["alpha_s"] * 1e6, 1 / fit.params["beta_s_per_byte"] / 1e9, fit


SWEEP_H200 = ROOT / "benchmarks" / "results" / "h200_20261204d" / "kernels"
"""A kernel sweep measured on one H200 by this repository (benchmarks/gpu_calibration.py,
torch 2.11.0+cu130): the only source of the unaligned-GEMM share below."""


def sweep_kernels() -> dict[str, KernelCost]:
    """The kernels `paratwin calibrate` fits to SWEEP_H200: bf16 GEMMs and elementwise ops,
    the fp32 optimizer (GPU time alone: each call queued behind a sleeping kernel)."""
    from paratwin.config import preset_cluster
    from twin.calibrate.profile import fit_kernels, read_csv

    rows = read_csv(SWEEP_H200 / "kernels.csv")
    _, by_dtype, _ = fit_kernels(rows, preset_cluster("dgx_h200"), CostModel(name="sweep"), "bf16")
    return {"gemm": by_dtype["bf16"]["gemm"], "elementwise": by_dtype["bf16"]["elementwise"],
            "optimizer": by_dtype["fp32"]["optimizer"]}


def unaligned_share() -> float:
    """The share of efficiency bf16 GEMMs of n or k not a multiple of 8 keep, as `paratwin
    calibrate` fits it to SWEEP_H200 (KernelCost.unaligned_efficiency)."""
    return sweep_kernels()["gemm"].unaligned_efficiency


LAUNCH_NOTE = ("measured here, not published: the fixed GPU time per op of {} in the H200 "
               "sweep's fit (each call queued behind a sleeping kernel; paratwin calibrate "
               f"bench_dir={SWEEP_H200.relative_to(ROOT)})")
A100_FIT = ROOT / "conf" / "profiles" / "dgx_a100.yaml"
HOST_NOTE = ("the A100 fit's (conf/profiles/dgx_a100.yaml: eager Megatron-DeepSpeed steps, 1,440 "
             "measured [vTrain, Bang et al. MICRO'24]); ASSUMPTION: a host's cost per op does not "
             "depend on the GPU it drives. Real eager training on one H200 here paid 124 us per op "
             "(benchmarks/results/h200_20261204e)")


def host_us_from_a100() -> dict[str, float]:
    """The host's microseconds per op of GEMMs, attention and elementwise ops fitted to the
    measured A100 steps (the optimizer's stayed at its start there: not measured)."""
    a100 = CostModel.load(A100_FIT)
    return {k: round(getattr(a100, k).host_us, 1) for k in ("gemm", "attention", "elementwise")}


def derive(gpu: str, job=None) -> tuple[CostModel, dict]:
    """The profile of dgx_<gpu> and, per parameter path, the source and arithmetic."""
    job = job or default_job()
    notes: dict[str, str] = {}
    copy = FIGURES[f"hbm_copy_{gpu}_TBps"][0] * 1e3 / HBM_GBPS[gpu]
    notes["hbm"] = f"STREAM Copy {FIGURES[f'hbm_copy_{gpu}_TBps'][0]} TB/s / {HBM_GBPS[gpu]:g} GB/s"
    ew_infl, opt_infl = eager_inflation(job)

    msmf, mamf = FIGURES["gemm_msmf_over_mamf"][0]
    sustained = msmf / mamf
    g_eff = FIGURES["gemm_mamf_tflops"][0] / PEAK_BF16 * sustained
    swept = sweep_kernels()
    unaligned = swept["gemm"].unaligned_efficiency
    launch = {k: round(v.launch_us, 2) for k, v in swept.items()}
    host = host_us_from_a100()
    gemm = KernelCost(efficiency=g_eff, half_flops=0.0, mem_efficiency=copy, launch_us=launch["gemm"],
                      host_us=host["gemm"], tile=128, tile_exponent=1.0, unaligned_efficiency=unaligned)
    fp8 = dataclasses.replace(
        gemm, efficiency=FIGURES["gemm_fp8_mamf_tflops"][0] / PEAK_FP8 * sustained)
    notes.update({
        "gemm.efficiency": f"MAMF {FIGURES['gemm_mamf_tflops'][0]} / {PEAK_BF16:g} TFLOP/s "
                           f"[{MAMF}] x sustained/burst {msmf}/{mamf} = {sustained:.4f} "
                           f"[{MSMF}]",
        "kernels_by_dtype.fp8.gemm.efficiency": (
            f"FP8 MAMF {FIGURES['gemm_fp8_mamf_tflops'][0]} / {PEAK_FP8:g} TFLOP/s "
            f"[{MAMF_FP8}] x the bf16 sustained/burst {sustained:.4f} (ASSUMPTION: no FP8 MSMF "
            "published)"),
        **{f"kernels_by_dtype.fp8.gemm.{f}": f"as gemm.{f}" for f in
           ("half_flops", "mem_efficiency", "launch_us", "host_us", "tile", "tile_exponent",
            "unaligned_efficiency")},
        "gemm.half_flops": "0: size dependence comes from tile and wave quantization below",
        "gemm.mem_efficiency": f"HBM Copy fraction: {notes['hbm']}",
        "gemm.launch_us": LAUNCH_NOTE.format("bf16 GEMMs"),
        "gemm.host_us": HOST_NOTE,
        "gemm.tile": "cuBLAS/CUTLASS Hopper bf16 CTA tile edge 128 (CUTLASS 3 sm90 default "
                     "128x128 / 128x256 tiles) over GPUSpec.sm_count=132",
        "gemm.tile_exponent": "ASSUMPTION: the whole tile and wave loss is paid (no H100 "
                              "figure separates it)",
        "gemm.unaligned_efficiency": (
            f"measured here, not published: the share of efficiency bf16 GEMMs of n or k not a "
            f"multiple of 8 kept on one H200 (n = 50,257 or 32,001: 130-141 TFLOP/s; paratwin "
            f"calibrate bench_dir={SWEEP_H200.relative_to(ROOT)})"
            + ("" if gpu == "h200" else "; ASSUMPTION: the H100's the same (one Hopper chip, "
               "the same cuBLAS kernels)")),
    })
    fa = attention_fit()
    scale = 1.0
    if gpu == "h200":
        scale = FIGURES["fa2_azure_h200_tflops"][0] / FIGURES["fa2_azure_h100_tflops"][0]
    attention = KernelCost(efficiency=fa.params["efficiency"] * scale, half_flops=0.0,
                           mem_efficiency=copy, launch_us=fa.params["launch_us"],
                           host_us=host["attention"], tile=0, tile_exponent=1.0)
    notes.update({
        "attention.efficiency": "fit_kernel over FlashAttention-2 H100 forward-causal and "
                                f"backward TFLOP/s, 512..16k [{FA3}]"
                                + (f"; x {scale:.4f} = Azure FA2 H200/H100 "
                                   f"{FIGURES['fa2_azure_h200_tflops'][0]}/"
                                   f"{FIGURES['fa2_azure_h100_tflops'][0]}" if gpu == "h200"
                                   else "") + f"; median |residual| {fa.median_abs_residual:.3f}",
        "attention.half_flops": "0 (the fit's launch term carries the size dependence)",
        "attention.mem_efficiency": f"HBM Copy fraction: {notes['hbm']}",
        "attention.launch_us": "the same fit_kernel (launch term)",
        "attention.host_us": HOST_NOTE,
    })
    elementwise = KernelCost(efficiency=0.5, half_flops=0.0, mem_efficiency=copy / ew_infl,
                             launch_us=launch["elementwise"], host_us=host["elementwise"], tile=0,
                             tile_exponent=1.0)
    notes.update({
        "elementwise.efficiency": "unused in practice (memory-bound: bytes decide); 0.5 of peak",
        "elementwise.mem_efficiency": f"HBM Copy fraction {copy:.4f} / eager-vs-fused byte "
                                      f"ratio {ew_infl:.3f} of the default job's elementwise "
                                      "ops (EAGER table: torchtitan Llama in eager PyTorch)",
        "elementwise.launch_us": LAUNCH_NOTE.format("bf16 elementwise ops"),
        "elementwise.host_us": HOST_NOTE,
    })
    optimizer = KernelCost(efficiency=0.5, half_flops=0.0, mem_efficiency=copy / opt_infl,
                           launch_us=launch["optimizer"], host_us=500.0, tile=0, tile_exponent=1.0)
    notes.update({
        "optimizer.efficiency": "unused in practice (memory-bound); 0.5 of peak",
        "optimizer.mem_efficiency": f"HBM Copy fraction {copy:.4f} / fused AdamW (torchtitan's "
                                    f"default) {ADAMW_FUSED_BYTES} B/param over the twin's "
                                    f"{28} B/param ({opt_infl:.3f}x)",
        "optimizer.launch_us": LAUNCH_NOTE.format("fused Adam steps"),
        "optimizer.host_us": "ASSUMPTION: fused AdamW over ~290 parameter tensors: one "
                             "multi-tensor launch per chunk plus the optimizer's Python "
                             "bookkeeping per tensor; ~0.5 ms host",
    })
    intra = LinkCost(bw_efficiency=FIGURES["nvlink_ring_busbw"][0] / NVLINK_GBPS, latency_us=None)
    inter = LinkCost(bw_efficiency=FIGURES["ndr_nic_GBps"][0] / NDR_GBPS, latency_us=None)
    notes["intra.bw_efficiency"] = (f"ring busbw {FIGURES['nvlink_ring_busbw'][0]:g} / NVLink "
                                    f"{NVLINK_GBPS:g} GB/s [{FIGURES['nvlink_ring_busbw'][1]}]")
    notes["intra.latency_us"] = "null: the cluster preset's NCCL hwLat (3.4 us)"
    notes["inter.bw_efficiency"] = (f"{FIGURES['ndr_nic_GBps'][0]:g} / {NDR_GBPS:g} GB/s per NIC "
                                    f"[{FIGURES['ndr_nic_GBps'][1]}]")
    notes["inter.latency_us"] = "null: the cluster preset's NCCL hwLat NET (14 us)"

    alpha, bw8, arfit = allreduce_fit(FIGURES[f"allreduce_busbw_{gpu}"][0])
    fits = {"all_reduce/intra/8": {
        "latency_us": alpha, "bw_GBps": bw8,
        "residual_median": arfit.median_abs_residual, "residual_max": arfit.max_abs_residual,
        "points": len(FIGURES[f"allreduce_busbw_{gpu}"][0])}}
    notes["collective_fits.all_reduce/intra/8"] = (
        f"fit_latency_bandwidth over {FIGURES[f'allreduce_busbw_{gpu}'][1]}, algbw = busbw x "
        "8/14")
    for n, busbw in FIGURES["allreduce_busbw_by_n"][0].items():
        if n == N_NODE:
            continue
        fits[f"all_reduce/intra/{n}"] = {"latency_us": alpha,
                                         "bw_GBps": busbw * n / (2 * (n - 1)),
                                         "points": 1}
        notes[f"collective_fits.all_reduce/intra/{n}"] = (
            f"busbw {busbw} x {n}/{2 * (n - 1)} [{FIGURES['allreduce_busbw_by_n'][1]}]; latency "
            "of the 8-GPU fit (ASSUMPTION)")
    base, hop = FIGURES["nccl_ring_ll_lat_us"][0]
    for kind in ("all_gather", "reduce_scatter"):
        busbw = FIGURES[f"{kind}_busbw"][0]
        for n in range(2, N_NODE + 1):
            fits[f"{kind}/intra/{n}"] = {"latency_us": base + (n - 1) * hop,
                                         "bw_GBps": busbw * n / (n - 1), "points": 1}
            notes[f"collective_fits.{kind}/intra/{n}"] = (
                f"busbw {busbw:g} x {n}/{n - 1} [{FIGURES[f'{kind}_busbw'][1]}; ASSUMPTION: "
                f"flat in n as the ring's ~370]; latency {base} + {n - 1} x {hop} us "
                f"[{FIGURES['nccl_ring_ll_lat_us'][1]}]")
    gname = {"h100": "H100-SXM5-80GB", "h200": "H200-SXM-141GB"}[gpu]
    cost = CostModel(
        name=f"dgx_{gpu}", gemm=gemm, attention=attention, elementwise=elementwise,
        optimizer=optimizer, intra=intra, inter=inter,
        base_latency_us=base, host_comm_us=20.0, host_comm_per_rank_us=1.0,
        p2p_host_sync=False, p2p_latency_us=None,
        overlap_slowdown=FIGURES["overlap_slowdown"][0], core_share=True,
        cores_effective=None, kernels_by_dtype={"fp8": {"gemm": fp8}}, collective_fits=fits,
        compute_cv=0.0,
        comm_cv=0.0, eager_elementwise=ew_infl,
        compiled_reduction_efficiency=FIGURES["compiled_norm_vs_sota"][0],
        provenance={"source": "published H100/H200 measurements, derived by "
                              "benchmarks/h100_profile.py (no measured step times)",
                    "cluster": f"dgx_{gpu}", "gpus": [gname], "backend": "nccl",
                    "benchmark": "python benchmarks/h100_profile.py --write"})
    notes.update({
        "base_latency_us": f"NCCL baseLat Ring/LL {base} us [published.md §5.3], for collectives "
                           "without a fit",
        "host_comm_us": "ASSUMPTION: c10d ProcessGroupNCCL issue cost of one collective; no "
                        "published figure",
        "host_comm_per_rank_us": "ASSUMPTION: 1 us per member; no published figure",
        "p2p_host_sync": "false: FSDP/torchtitan do not synchronize the host after send/recv",
        "overlap_slowdown": f"{FIGURES['overlap_slowdown'][0]:g}: compute runs this much slower "
                            f"while a collective of its rank is in flight (twin/sim/overlap.py) "
                            f"[{FIGURES['overlap_slowdown'][1]}]",
        "compute_cv": "0: no published run-to-run spread", "comm_cv": "0: as compute_cv",
        "eager_elementwise": f"eager-vs-fused byte ratio {ew_infl:.3f} (the EAGER table), folded "
                             "into elementwise.mem_efficiency and host_us; parallel.compile=true "
                             "takes it back out",
        "compiled_reduction_efficiency": f"{FIGURES['compiled_norm_vs_sota'][0]:g} of the fused "
                                         f"bandwidth for compiled norms and the loss "
                                         f"[{FIGURES['compiled_norm_vs_sota'][1]}]",
        "reduction_efficiency": "1: set by parallel.compile=true (compiled_reduction_efficiency)",
    })
    return cost, notes


# -- writing the YAML with a comment beside every value ---------------------------------------
def _fmt(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(round(v, 6)) if not v.is_integer() else repr(v)
    return str(v)


def to_yaml(cost: CostModel, notes: dict) -> str:
    d = cost.to_dict()
    out = [f"# DGX {cost.name[4:].upper()} cost profile, derived from published measurements by",
           "# benchmarks/h100_profile.py (do not edit by hand: rerun it with --write).",
           "# Every value names its source and arithmetic; ASSUMPTION marks a value no",
           "# published H100/H200 figure pins down. Nothing is taken from the A100 fit but",
           "# the host's cost per op (the host's and the framework's, not the GPU's)."]
    for key, val in d.items():
        if key == "provenance":
            continue
        if isinstance(val, dict) and not val and key != "kernels_by_dtype":
            note = notes.get(key, "")
            out.append(f"{key}: {{}}" + (f"  # {note}" if note else ""))
        elif isinstance(val, dict) and key != "kernels_by_dtype":
            out.append(f"{key}:")
            for k2, v2 in val.items():
                if isinstance(v2, dict):
                    out.append(f"  {k2}:  # {notes.get(f'{key}.{k2}', '')}")
                    for k3, v3 in v2.items():
                        out.append(f"    {k3}: {_fmt(v3)}")
                else:
                    note = notes.get(f"{key}.{k2}", "")
                    out.append(f"  {k2}: {_fmt(v2)}" + (f"  # {note}" if note else ""))
        elif key == "kernels_by_dtype":
            out.append("kernels_by_dtype:  # the kinds above except where a dtype has its own")
            for dtype, kinds in val.items():
                out.append(f"  {dtype}:")
                for kind, fields in kinds.items():
                    out.append(f"    {kind}:")
                    for k3, v3 in fields.items():
                        note = notes.get(f"{key}.{dtype}.{kind}.{k3}", "")
                        out.append(f"      {k3}: {_fmt(v3)}" + (f"  # {note}" if note else ""))
        else:
            note = notes.get(key, "")
            out.append(f"{key}: {_fmt(val)}" + (f"  # {note}" if note else ""))
    out.append("provenance:")
    for k, v in d["provenance"].items():
        out.append(f"  {k}: " + (f"[{', '.join(v)}]" if isinstance(v, list) else f"'{v}'"))
    return "\n".join(out) + "\n"


# -- the twin against published H100 runs ------------------------------------------------------
# torchtitan benchmarks/llama3_h100_202412_torchtitan.md (pytorch/torchtitan, Dec 2024): Llama 3.1
# 8B, FSDP, local batch 2, seq 8192, selective (op) activation checkpointing, eager, bf16, on
# Grand Teton H100s (96 GB HBM2e, 2.4 TB/s, 500 W power limit). MFU = TPS x 6N+12lhqt FLOPs per
# token / 989 TFLOP/s (torchtitan's own definition; equals the twin's model FLOPs).
# Their parts' HBM (2.4 TB/s, the datasheet's) and torchtitan's op-level SAC (recompute=op) are
# given to the twin; their 500 W power limit is not (the twin has no power model).
THEIRS = ["parallel.micro_batch_size=2", "parallel.recompute=op", "cluster.gpu.hbm_bw_GBps=2400"]
# Their parts' peak is not published: "The H100 GPUs used for the experiments are non-standard.
# They have HBM2e and are limited to a lower TDP. The actual peak TFLOPs should be between SXM
# and NVL" (Liang et al., TorchTitan, arXiv:2410.06511, Table 1's note). So each run is predicted
# at both ends: SXM's 989 and NVL's 835 dense bf16 TFLOP/s (H100 NVL datasheet: 1,671 with
# sparsity), the GEMM efficiency (a fraction of peak) kept.
PEAK_NVL_BF16 = 835.0
PUBLISHED = [
    ("torchtitan 8B FSDP, 8 H100 (Table 1)", THEIRS, 5762),
    ("torchtitan 8B FSDP, 128 H100 (Table 3)", ["cluster.num_nodes=16", *THEIRS], 5605),
]


def predict(job, cost):
    from twin.sim.records import SimOptions
    from twin.sim.run import simulate
    fold = "dp" if job.cluster.num_nodes > 1 else "none"
    return simulate(job, cost, SimOptions(fold=fold)).summary


def flops_per_token(model) -> float:
    from twin.workload.flops import model_flops_per_step
    return model_flops_per_step(model, 1) / model.seq_len


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="write conf/profiles/dgx_h1x0.yaml")
    args = ap.parse_args()
    from paratwin.config import load_profile
    job = default_job()
    for gpu in ("h100", "h200"):
        cost, notes = derive(gpu, job)
        print(f"== dgx_{gpu}")
        for path in ("gemm.efficiency", "attention.efficiency", "attention.launch_us",
                     "elementwise.mem_efficiency", "optimizer.mem_efficiency",
                     "intra.bw_efficiency", "inter.bw_efficiency"):
            kind, field = path.split(".")
            print(f"  {path:<28} {getattr(getattr(cost, kind), field):8.4f}  {notes[path][:90]}")
        f8 = cost.collective_fits["all_reduce/intra/8"]
        print(f"  {'all_reduce/intra/8':<28} {f8['latency_us']:6.1f} us + S / {f8['bw_GBps']:.1f}"
              f" GB/s (busbw {f8['bw_GBps'] * 14 / 8:.0f}; median |res| "
              f"{f8['residual_median']:.3f})")
        if args.write:
            path = ROOT / "conf" / "profiles" / f"dgx_{gpu}.yaml"
            path.write_text(to_yaml(cost, notes))
            CostModel.load(path)  # a valid profile (ConfigError names any bad field)
            print(f"  wrote {path.relative_to(ROOT)}")
    print("\nthe default job (paratwin simulate: llama3_8b, fsdp, 1x dgx_h100, calibration=auto)")
    for name in ("dgx_h100", "dgx_h200"):
        j = default_job([f"cluster={name}"])
        cost = load_profile("auto", j.cluster)
        s = predict(j, cost)
        print(f"  {name}: profile {cost.name:<18} MFU {s['mfu']:6.1%}  step {s['step_time_s']:.3f} s"
              f"  critical path {fmt_path(s)}")
    print("\npublished H100 runs (torchtitan, eager bf16), measured vs predicted on dgx_h100 at "
          f"their parts' peak bounds (SXM {PEAK_BF16:g}, NVL {PEAK_NVL_BF16:g} TFLOP/s):")
    fpt = flops_per_token(job.model)
    for label, ov, tps in PUBLISHED:
        preds = []
        for peak in (PEAK_BF16, PEAK_NVL_BF16):
            j = default_job([*ov, f"cluster.gpu.peak_tflops.bf16={peak:g}"])
            s = predict(j, load_profile("auto", j.cluster))
            preds.append(s["tokens_per_s"] / s["world_size"])
        print(f"  {label:<40} TPS/GPU {tps:>6} (MFU {tps * fpt / PEAK_BF16 / 1e12:5.1%})  "
              f"twin {preds[0]:5.0f} .. {preds[1]:5.0f}  err {preds[0] / tps - 1:+.0%} .. "
              f"{preds[1] / tps - 1:+.0%}")
    print("  (their H100s: HBM2e at 2.4 TB/s and torchtitan's op-level SAC, both simulated; their "
          "lower TDP as the peak's range; GEMMs at a 700 W part's sustained clock, slowed beside NCCL "
          "kernels; the lower clock of their 500 W limit is not modelled)")


def fmt_path(s) -> str:
    cp = s.get("critical_path_s") or {}
    tot = sum(cp.values()) or 1.0
    return ", ".join(f"{k} {v / tot:.0%}" for k, v in sorted(cp.items(), key=lambda kv: -kv[1])
                     if v / tot >= 0.01)


if __name__ == "__main__":
    main()
