"""PyTorch's own DDP, FSDP2, DTensor TP/SP and pipelining against the schedule, on gloo ranks.

Each plan trains the tiny Llama-style model for 3 steps: every collective and p2p call
of the last step must equal the schedule's (per group and kind: count and bytes; order
for collectives) or be explained by a documented rule, and the losses must equal the
single-process run's to 1e-5 relative.
"""

from __future__ import annotations

import json

import pytest

from tests.conformance.test_compare import tiny
from tests.conftest import cluster
from tests.executor.helpers import paratwin
from twin.spec import ParallelPlan, build_job

pytest.importorskip("torch")

from executor.conformance.compare import compare, ir_entries, torch_entries  # noqa: E402
from executor.conformance.rank import result_path  # noqa: E402
from executor.conformance.runner import conform  # noqa: E402

SP_NORMS = dict(sp_norm_grad_sync="per_tensor")
PLANS = {  # name: (world size, plan)
    "ddp": (2, dict()),
    "fsdp2": (2, dict(zero_stage=3)),
    "fsdp2_keep": (2, dict(zero_stage=3, fsdp_reshard_after_forward=False)),
    "tp": (2, dict(tp=2)),
    "tp_sp": (2, dict(tp=2, sp=True, **SP_NORMS)),
    "gpipe": (2, dict(pp=2, pp_schedule="gpipe")),
    "1f1b": (2, dict(pp=2, pp_schedule="1f1b")),
    "interleaved": (2, dict(pp=2, pp_schedule="interleaved", pp_virtual_stages=2)),
    "fsdp2_tp_sp": (4, dict(zero_stage=3, tp=2, sp=True, **SP_NORMS)),
    "ddp_tp": (4, dict(tp=2)),
    "pp_tp_sp": (4, dict(pp=2, tp=2, sp=True, **SP_NORMS)),
    "pp_ddp": (4, dict(pp=2, dp=2)),
    "hsdp": (4, dict(zero_stage=3, dp_replicate=2)),
    # torchtitan's op-level SAC: its recomputation gathers again under SP, all-reduces out_proj
    # again under plain TP, and issues nothing more under FSDP2 or DDP
    "tp_sp_op_sac": (2, dict(tp=2, sp=True, recompute="op", **SP_NORMS)),
    "tp_op_sac": (2, dict(tp=2, recompute="op")),
    "fsdp2_op_sac": (2, dict(zero_stage=3, recompute="op")),
    "fsdp2_tp_sp_op_sac": (4, dict(zero_stage=3, tp=2, sp=True, recompute="op", **SP_NORMS)),
    # torchtitan's full AC: PyTorch's non-reentrant checkpoint stops before fc2 and its reduction
    "tp_sp_full": (2, dict(tp=2, sp=True, recompute="full", recompute_early_stop=True,
                           **SP_NORMS)),
    "tp_full": (2, dict(tp=2, recompute="full", recompute_early_stop=True)),
    "fsdp2_full": (2, dict(zero_stage=3, recompute="full", recompute_early_stop=True)),
}


def _job(world: int, plan: dict):
    return build_job(tiny(), cluster(gpus=world), ParallelPlan(**plan))


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", PLANS)
def test_pytorch_issues_what_the_schedule_says_and_trains_alike(name, tmp_path):
    world, plan = PLANS[name]
    job = _job(world, plan)
    res = conform(job, tmp_path / "run", steps=3, timeout_s=120, log=lambda m: None)
    assert res["differences"] == [], json.dumps(res["differences"], indent=1)
    lo = res["losses"]
    assert lo["match"], lo
    assert max(lo["relative_error"]) <= 1e-5
    for rows in res["ranks"].values():  # every rank moved what the schedule says
        assert rows and all(r["ir_count"] == r["torch_count"] and r["ir_bytes"] == r["torch_bytes"]
                            for r in rows)
    if name == "tp_sp":  # the option is what makes it agree: without it, 9 norm all-reduces
        plain = _job(world, {**plan, "sp_norm_grad_sync": "none"})
        from twin.schedule.builder import build_schedule

        calls = json.loads(result_path(tmp_path / "run", 0).read_text())["calls"]
        diffs = compare(plain, 0, ir_entries(build_schedule(plain).program(0)),
                        torch_entries(calls, 2, 0))
        assert [(d.what, d.kind, d.torch_count - d.ir_count, d.torch_bytes - d.ir_bytes)
                for d in diffs] == [("count", "all_reduce", 9, 9 * 64 * 4)]
    if name in ("tp_sp_op_sac", "tp_op_sac", "tp_sp_full", "tp_full"):  # what PyTorch re-ran
        _assert_recomputed_calls(job, plan, tmp_path / "run")
    if name == "ddp":  # DDP rebuilds its buckets once, in the second step's forward
        assert {(w["step"], w["kind"]) for w in res["warmup_extras"]} == {(1, "broadcast")}


def _assert_recomputed_calls(job, plan: dict, run) -> None:
    """Against the schedule without checkpointing, PyTorch's step issued one call more per
    layer and micro-batch for each call its recomputation re-runs, of the activation's bytes,
    and nothing else: op-level SAC under SP norm1's and norm2's all-gathers, under plain TP
    out_proj's all-reduce; full AC (stopping early) the forward's calls but fc2's reduction."""
    from twin.schedule.builder import build_schedule

    plain = _job(2, {**plan, "recompute": "none"})
    calls = json.loads(result_path(run, 0).read_text())["calls"]
    diffs = compare(plain, 0, ir_entries(build_schedule(plain).program(0)),
                    torch_entries(calls, 2, 0))
    m, layers = job.parallel.num_microbatches, job.model.num_layers
    act = job.parallel.micro_batch_size * job.model.seq_len * job.model.hidden_size * 4
    full = plan["recompute"] == "full"
    per_layer = {"all_gather": 2, "reduce_scatter": 1 if full else 0} if plan.get("sp") else \
        {"all_reduce": 1}
    counted = sorted((d.kind, d.torch_count - d.ir_count, d.torch_bytes - d.ir_bytes)
                     for d in diffs if d.what == "count")
    assert counted == [(k, n * layers * m, n * layers * m * act)
                       for k, n in sorted(per_layer.items()) if n], counted


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize("bucket_MB, buckets", [(25, 1), (1, 3)])
def test_ddp_steady_state_buckets_above_1_MiB_equal_pytorchs(bucket_MB, buckets, tmp_path):
    """DDP with gradients over 1 MiB (2.9 MB: tiny at h=128, f=256): its first step
    all-reduces every gradient in one bucket; from the second step on, rebuilt in gradient
    order, its buckets are capped at ``bucket_cap_mb``, the first one included (torch 2.13,
    torch/nn/parallel/distributed.py: the 1 MiB first bucket is only for the default
    cap). The schedule's buckets, one at 25 MiB, three at 1 MiB, are PyTorch's, call by
    call (count, bytes and order)."""
    job = build_job(tiny(hidden_size=128, ffn_hidden_size=256), cluster(gpus=2),
                    ParallelPlan(ddp_bucket_MB=bucket_MB))
    res = conform(job, tmp_path / "run", steps=3, timeout_s=120, log=lambda m: None)
    assert res["differences"] == [], json.dumps(res["differences"], indent=1)
    assert res["losses"]["match"], res["losses"]
    for rows in res["ranks"].values():
        (ar,) = [r for r in rows if (r["group_name"], r["kind"]) == ("dp", "all_reduce")]
        assert ar["ir_count"] == ar["torch_count"] == buckets
        assert ar["ir_bytes"] == ar["torch_bytes"] > 1024 * 1024
    first = {(w["step"], w["kind"], w["count"]) for w in res["warmup_extras"] if w["rank"] == 0}
    assert first == ({(1, "broadcast", 2)} | ({(0, "all_reduce", 1)} if buckets > 1 else set()))


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_cli_prints_both_inventories_as_json_with_an_empty_differences_list(tmp_path):
    out = paratwin("conformance", "parallel=fsdp", "format=json", f"out_dir={tmp_path}/run",
                   timeout=170)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["differences"] == [] and res["losses"]["match"]
    rows = {(r["group_name"], r["kind"]): r for r in res["ranks"]["0"]}
    assert rows[("dp", "all_gather")]["torch_count"] == 5 + 4  # forward, then backward re-gathers
    assert rows[("dp", "reduce_scatter")]["torch_bytes"] == rows[("dp", "reduce_scatter")]["ir_bytes"]


def test_cli_refuses_a_plan_pytorch_has_no_counterpart_for_before_spawning(tmp_path):
    out = paratwin("conformance", "parallel=zero1", f"out_dir={tmp_path}/run", timeout=60)
    assert out.returncode == 2
    assert "zero_stage=1 has no PyTorch-native counterpart" in out.stderr
    assert not (tmp_path / "run").exists()
