"""Shared fixtures: small specs that tests vary with dataclasses.replace."""

from __future__ import annotations

import pytest

from twin.spec import ClusterSpec, GPUSpec, ModelSpec, ParallelPlan


def gpt(**kw) -> ModelSpec:
    """A GPT-style model (MHA, f = 4h, LayerNorm, biases, dropout)."""
    base = dict(name="gpt", num_layers=8, hidden_size=256, num_heads=8, num_kv_heads=8,
                ffn_hidden_size=1024, vocab_size=1000, seq_len=128, activation="gelu",
                dtype="bf16")
    base.update(kw)
    return ModelSpec(**base)


def cluster(nodes: int = 1, gpus: int = 8, **kw) -> ClusterSpec:
    """A DGX-like cluster with the given shape."""
    return ClusterSpec(name="test", num_nodes=nodes, gpus_per_node=gpus,
                       gpu=GPUSpec(name="g", peak_tflops={"bf16": 100.0, "fp32": 10.0}), **kw)


@pytest.fixture
def model() -> ModelSpec:
    return gpt()


@pytest.fixture
def plan() -> ParallelPlan:
    return ParallelPlan()
