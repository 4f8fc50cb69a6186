"""The experts section: each MoE layer's expert loads from the routing model, and the
expert-parallel all-to-all each layer leaves exposed, from the trace."""

from __future__ import annotations

import numpy as np

from tests.conftest import cluster, gpt
from tests.report.conftest import write_run
from twin.report import Options, write_report
from twin.report.moe import expert_loads, exposed_a2a_per_layer
from twin.spec import ParallelPlan, build_job
from twin.spec.moe import MoESpec
from twin.trace import Trace


def _job(skew: float):
    moe = MoESpec(num_experts=8, experts_per_token=2, moe_ffn_hidden_size=512,
                  routing="skewed" if skew else "uniform", routing_skew=skew)
    return build_job(gpt(num_layers=2, activation="swiglu", moe=moe), cluster(gpus=4),
                     ParallelPlan(ep=4))


def test_loads_are_the_routing_models_over_the_mean():
    layers, even = expert_loads(_job(0.0))
    assert layers == [0, 1] and np.allclose(even, 1.0)
    _, skew = expert_loads(_job(0.8))
    assert skew.shape == (2, 8) and np.allclose(skew.mean(axis=1), 1.0)
    assert skew.max() > 1.2 and skew.min() < 0.8


def test_exposed_all_to_all_per_layer_and_the_section(tmp_path):
    run = tmp_path / "moe"
    write_run(run, _job(0.8))
    per_layer = exposed_a2a_per_layer(Trace.load(run / "spans.json"))
    assert sorted(per_layer) == [0, 1] and all(v > 0 for v in per_layer.values())
    html = write_report([run], tmp_path / "r.html", options=Options(chrome=False)).read_text()
    assert "experts: moe" in html and "exposed all-to-all per layer" in html
    assert "expert load per layer" in html


def test_a_dense_run_has_no_experts_section(tmp_path):
    run = tmp_path / "dense"
    write_run(run, build_job(gpt(num_layers=2), cluster(gpus=2), ParallelPlan()))
    html = write_report([run], tmp_path / "r.html", options=Options(chrome=False)).read_text()
    assert "experts:" not in html
