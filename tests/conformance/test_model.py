"""The conformance model and plan checks: canonical parameter order, plans PyTorch cannot run."""

from __future__ import annotations

import dataclasses

import pytest

from tests.conformance.test_compare import tiny
from tests.conftest import cluster
from twin.spec import ConfigError, ParallelPlan, build_job
from twin.workload.params import embedding_tensors, head_tensors, layer_tensors

torch = pytest.importorskip("torch")

from executor.conformance.model import build_model, check_model, make_batch  # noqa: E402
from executor.conformance.parallelize import check_plan, chunk_layers, pipeline_chunks  # noqa: E402

ALIASES = {"wq": "attn.wq", "wk": "attn.wk", "wv": "attn.wv", "wo": "attn.wo",
           "w_gate": "mlp.w_gate", "w_up": "mlp.w_up", "fc2": "mlp.fc2"}


def canonical(spec) -> list[tuple[str, int]]:
    """twin.workload.params' registration order, spelled as the module names its parameters."""
    out = [(t.name, t.numel) for t in embedding_tensors(spec)]
    for i in range(spec.num_layers):
        for t in layer_tensors(spec):
            mod, _, leaf = t.name.rpartition(".")
            out.append((f"layers.{i}.{ALIASES.get(mod, mod)}.{leaf}", t.numel))
    out += [(t.name, t.numel) for t in head_tensors(spec)]
    return out


@pytest.mark.parametrize("tied", [False, True])
def test_parameters_register_in_the_twins_order_with_its_sizes(tied):
    spec = tiny(tie_embeddings=tied)
    got = [(n, p.numel()) for n, p in build_model(spec, 0).named_parameters()]
    assert got == canonical(spec)


def test_initialisation_and_data_are_deterministic():
    spec = tiny()
    a, b = build_model(spec, 3), build_model(spec, 3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(build_model(spec, 4).embed.weight, a.embed.weight)
    x, y = make_batch(spec, 2, 7)
    assert x.shape == (2, 64) and torch.equal(x[:, 1:], y[:, :-1])


def test_pipeline_chunks_keep_their_layers_and_the_ends():
    job = build_job(tiny(), cluster(gpus=2), ParallelPlan(pp=2, pp_schedule="interleaved",
                                                          pp_virtual_stages=2))
    assert chunk_layers(job) == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    chunks = pipeline_chunks(build_model(job.model, 0), job, stage=1)
    assert [c for c, _ in chunks] == [1, 3]
    (_, first), (_, last) = chunks
    assert list(first.layers) == ["1"] and first.embed is None and first.lm_head is None
    assert list(last.layers) == ["3"] and last.lm_head is not None


def test_gpt_style_models_and_low_precision_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match="Llama-style"):
        check_model(tiny(activation="gelu"))
    with pytest.raises(ConfigError, match="model.dtype=fp32"):
        check_model(tiny(dtype="bf16"))


@pytest.mark.parametrize("plan, words", [
    (dict(zero_stage=1), "zero_stage=1 has no PyTorch-native"),
    (dict(legacy_dp=True), "nn.DataParallel"),
    (dict(tp=2, recompute="full"), "set parallel.recompute_early_stop=true"),
    (dict(tp=2, recompute="selective"), "no PyTorch-native counterpart"),
    (dict(pp=2, zero_stage=3), "zero_stage=3 with pp > 1"),
    (dict(pp=2, pp_schedule="gpipe"), "ScheduleGPipe trips DDP's Reducer"),
    (dict(zero_stage=3, fsdp_reduce_dtype="bf16"), "set parallel.fsdp_reduce_dtype=fp32"),
])
def test_plans_without_a_pytorch_counterpart_say_what_to_use(plan, words):
    job = build_job(tiny(), cluster(gpus=4 if plan.get("pp") else 2), ParallelPlan(**plan))
    with pytest.raises(ConfigError, match=words):
        check_plan(job)


def test_tp_beyond_kv_heads_is_refused_since_colwise_would_split_a_head():
    job = build_job(tiny(), cluster(gpus=4), ParallelPlan(tp=4))
    with pytest.raises(ConfigError, match="num_kv_heads=4"):
        check_plan(job)
    check_plan(build_job(dataclasses.replace(tiny(), num_kv_heads=4), cluster(gpus=4),
                         ParallelPlan(tp=4)))
