"""The search's fast estimate against the twin, plan by plan, on the plan classes it has
mispriced before.

Run: python benchmarks/bench_estimate.py [small] [gpt3] [mixtral]   (default: all)

- small: the test model of tests/search (8 layers, hidden 512) on 16 H100s, with and
  without the host waiting at each pipeline exchange (``p2p_host_sync``): FSDP in 1F1B and
  interleaved pipelines (resharded or kept), and the split-backward schedules (ZB-H1, ZB-V,
  DualPipeV) with gradients reduced every micro-batch (ZeRO-1 ``grad_sync=every``, DDP);
  about a minute.
- gpt3: GPT-3 175B on 1,024 A100s (dgx_a100's profile, host waits at each exchange), global
  batch 1024: FSDP in pipelines, where a layer's gather takes longer than its compute;
  about two minutes.
- mixtral: Mixtral 8x7B on 64 H100s, global batch 256: experts not tensor-parallel
  (etp=1) under ZeRO, whose 940 MB expert tensors are a gradient bucket each; a minute.

Prints each plan's estimate, the twin's step and the error, then per group the median
and largest absolute error. Figures, not pass/fail.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_search import preset_model  # noqa: E402
from paratwin.config import load_profile, preset_cluster  # noqa: E402
from twin.cost import default_cost_model  # noqa: E402
from twin.search.check import simulate_candidate  # noqa: E402
from twin.search.estimate import Estimator  # noqa: E402
from twin.search.memory import SearchJob  # noqa: E402
from twin.search.run import Candidate  # noqa: E402
from twin.spec import ModelSpec, ParallelPlan, build_job  # noqa: E402

MODEL = ModelSpec(name="gpt", num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=8,
                  ffn_hidden_size=2048, vocab_size=8000, seq_len=512, activation="gelu",
                  dtype="bf16")
"""tests/search's test model."""
H100x2 = dataclasses.replace(preset_cluster("dgx_h100"), num_nodes=2)

def _small():
    for sync in (False, True):
        cost = dataclasses.replace(default_cost_model(H100x2), p2p_host_sync=sync)
        for sched, v in (("1f1b", 1), ("interleaved", 2)):
            for reshard in (True, False):
                for pp, tp in ((2, 1), (4, 1), (2, 2), (4, 2)):
                    yield f"sync={sync}", MODEL, H100x2, cost, 16, ParallelPlan(
                        pp=pp, tp=tp, pp_schedule=sched, pp_virtual_stages=v, zero_stage=3,
                        fsdp_reshard_after_forward=reshard, global_batch_size=64)
        if sync:
            for sched, v in (("zb_h1", 1), ("zb_v", 2), ("dualpipev", 2)):
                for zero in (0, 1):
                    yield "split, every", MODEL, H100x2, cost, 16, ParallelPlan(
                        pp=4, pp_schedule=sched, pp_virtual_stages=v, zero_stage=zero,
                        grad_sync="every", global_batch_size=64)


def _preset(name: str, cluster: str, nodes: int):
    base = dataclasses.replace(preset_cluster(cluster), num_nodes=nodes)
    return preset_model(name), base, load_profile(cluster, base)


def _gpt3():
    model, cluster, cost = _preset("gpt3_175b", "dgx_a100", 128)
    for kw in (dict(tp=8, pp=8, pp_schedule="interleaved", pp_virtual_stages=4),
               dict(tp=8, pp=8, pp_schedule="interleaved", pp_virtual_stages=2,
                    fsdp_reshard_after_forward=False),
               dict(tp=4, pp=16, pp_schedule="interleaved", pp_virtual_stages=2, sp=True),
               dict(tp=8, pp=4, pp_schedule="interleaved", pp_virtual_stages=4, sp=True),
               dict(tp=8, pp=8), dict(tp=2)):
        yield "gpt3 fsdp", model, cluster, cost, 1024, ParallelPlan(
            zero_stage=3, global_batch_size=1024, **kw)


def _mixtral():
    model, cluster, cost = _preset("mixtral_8x7b", "dgx_h100", 8)
    for kw in (dict(tp=4, etp=1, zero_stage=1), dict(tp=4, pp=4, etp=1, zero_stage=1),
               dict(tp=4, pp=4, etp=1, zero_stage=2),
               dict(tp=4, pp=4, etp=1, zero_stage=2, rank_order="pp-cp-tp-dp"),
               dict(tp=2, ep=8, etp=1, zero_stage=1), dict(tp=4, pp=8, ep=4, etp=1, zero_stage=2)):
        yield "mixtral etp=1", model, cluster, cost, 64, ParallelPlan(
            sp=True, micro_batch_size=4, global_batch_size=256, **kw)


GROUPS = {"small": _small, "gpt3": _gpt3, "mixtral": _mixtral}


def main() -> None:
    warnings.simplefilter("ignore")
    errors: dict[str, list[float]] = {}
    for name in sys.argv[1:] or list(GROUPS):
        estimators: dict[int, Estimator] = {}
        for group, model, cluster, cost, gpus, plan in GROUPS[name]():
            job = build_job(model, cluster, plan)
            est = estimators.setdefault(id(cost), Estimator(cost))
            e = est(SearchJob(model=model, cluster=cluster, parallel=job.parallel))
            twin = simulate_candidate(model, cluster, Candidate(job.parallel, gpus, 0.0, e),
                                      cost).summary.step_time_s
            err = e.step_time_s / twin - 1
            errors.setdefault(group, []).append(abs(err))
            p = job.parallel
            label = (f"tp{p.tp} pp{p.pp} dp{p.dp} zero{p.zero_stage} {p.pp_schedule} v"
                     f"{p.pp_virtual_stages} etp{p.expert_tp} ep{p.ep}"
                     f"{'' if p.fsdp_reshard_after_forward else ' keep'} {p.grad_sync} "
                     f"[{p.rank_order}]")
            print(f"{group:<14} {label:<72} estimate {e.step_time_s:9.4f} s  twin "
                  f"{twin:9.4f} s  {err:+.1%}", flush=True)
    for group, errs in errors.items():
        print(f"{group}: {len(errs)} plans, |error| median {statistics.median(errs):.1%}, "
              f"largest {max(errs):.1%}")


if __name__ == "__main__":
    main()
