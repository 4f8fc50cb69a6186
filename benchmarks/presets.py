"""Shared specs of the benchmark scripts: the DGX H100 node and the Llama 3 models, and jobs
composed as the CLI composes them."""

from __future__ import annotations

from twin.spec import ClusterSpec, GPUSpec, InterNodeSpec, IntraNodeSpec, ModelSpec

H100 = GPUSpec(name="H100-SXM5-80GB", peak_tflops={"bf16": 989.0}, hbm_GB=80, hbm_bw_GBps=3350)
LLAMA = {
    "llama3_8b": dict(num_layers=32, hidden_size=4096, num_heads=32, ffn_hidden_size=14336),
    "llama3_70b": dict(num_layers=80, hidden_size=8192, num_heads=64, ffn_hidden_size=28672),
    "llama3_405b": dict(num_layers=126, hidden_size=16384, num_heads=128, ffn_hidden_size=53248),
}


def llama3(name: str) -> ModelSpec:
    """Llama 3 (arXiv:2407.21783, Table 3) with the released 128,256-entry vocabulary."""
    return ModelSpec(name=name, num_kv_heads=8, vocab_size=128256, seq_len=8192,
                     activation="swiglu", **LLAMA[name])


def dgx_h100(nodes: int) -> ClusterSpec:
    """The dgx_h100 preset's figures (conf/cluster/dgx_h100.yaml)."""
    return ClusterSpec(name="dgx_h100", num_nodes=nodes, gpus_per_node=8, gpu=H100,
                       intra=IntraNodeSpec(kind="nvswitch", bw_GBps=450, latency_us=3.4),
                       inter=InterNodeSpec(nics_per_node=8, nic_bw_GBps=50, latency_us=14.0,
                                           topology="rail_optimized"))


def cli_job(*overrides: str):
    """(job, profile) as `paratwin simulate OVERRIDES` composes them (calibration=auto: the
    cluster's own profile where one is fitted)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from paratwin.config import CONF_DIR, job_from_cfg, load_profile, register_schemas

    register_schemas()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="simulate", overrides=list(overrides))
    job = job_from_cfg(cfg)
    return job, load_profile(cfg.get("calibration"), job.cluster)
