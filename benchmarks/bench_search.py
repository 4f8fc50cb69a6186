"""The plan search: how many plans a second, and how good its choice is.

    python benchmarks/bench_search.py [--workers 2] [--top 10] [--sample 10] [--only NAME]

1. Llama-3 70B on 1,024 H100s (conf/model/llama3_70b.yaml, conf/cluster/dgx_h100.yaml, its
   profile), global batch 1,024 sequences; 2. GPT-3 175B on 1,024 A100s (dgx_a100, its
   profile), the same batch; Mixtral 8x7B on 64 H100s, global batch 256 (its experts: ep,
   etp). For each: every legal plan enumerated, pruned by memory and
   ranked by the fast estimate (plans evaluated, fit, seconds, plans per second), the top
   K simulated with the full twin, and the gap of the estimate's choice: its simulated step
   time over the best simulated of those K, minus one; plus Spearman's rho of estimate
   against twin over those K and over a random sample of the plans that fit.
3. The A100 measured set (../shared/reference/a100_measured, read with the vtrain_a100
   column map as benchmarks/accuracy_a100.py does; profile conf/profiles/dgx_a100.yaml):
   in each group of interchangeable measured plans (model, GPUs, global batch) the search
   keeps the plans that fit, ranks them by the estimate, simulates the best K and picks the
   twin's fastest; its regret is the measured time of that pick over the group's measured
   best, minus one (per model: mean and largest), beside the regret of the estimate's own
   pick and of the twin over every measured plan.

Figures, not pass/fail. Results go to benchmarks/results/bench_search.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from paratwin.config import CONF_DIR, load_profile, preset_cluster  # noqa: E402
from paratwin.runs import column_map, jobs_from_runs  # noqa: E402
from twin.search import SearchSpace, agreement, evaluate  # noqa: E402
from twin.search.check import simulate_candidate  # noqa: E402
from twin.search.estimate import Estimator  # noqa: E402
from twin.search.memory import peak_memory  # noqa: E402
from twin.search.space import cluster_for  # noqa: E402
from twin.search.table import plan_label  # noqa: E402
from twin.sim.engine import SimOptions  # noqa: E402
from twin.sim.run import simulate  # noqa: E402
from twin.spec import ModelSpec  # noqa: E402

DATA = ROOT.parent / "shared" / "reference" / "a100_measured"
CASES = {"llama3_70b": ("llama3_70b", "dgx_h100", 1024, 1024),
         "gpt3_175b": ("gpt3_175b", "dgx_a100", 1024, 1024),
         "mixtral_8x7b": ("mixtral_8x7b", "dgx_h100", 64, 256)}


def preset_model(name: str) -> ModelSpec:
    import yaml

    fields = yaml.safe_load((CONF_DIR / "model" / f"{name}.yaml").read_text())
    return ModelSpec(**{k: v for k, v in fields.items() if k != "defaults"})


def _rho(check: dict) -> str:
    """Spearman's rho as printed (n/a under three plans, where it is not defined)."""
    return "n/a" if check["spearman"] is None else f"{check['spearman']:.3f}"


def search_case(name: str, args) -> dict:
    model_name, cluster_name, gpus, gbs = CASES[name]
    model, base = preset_model(model_name), preset_cluster(cluster_name)
    cost = load_profile("auto", cluster_for(base, gpus))
    space = SearchSpace(gpus=(gpus,), global_batch_size=gbs, gpus_per_node=base.gpus_per_node)
    print(f"\n== {model_name} on {gpus} x {base.gpu.name} ({cluster_name}, profile {cost.name}), "
          f"global batch {gbs} ==", flush=True)
    ev = evaluate(model, base, space, cost, workers=args.workers)
    rate = ev.evaluated / ev.seconds
    print(f"{ev.evaluated:,} plans evaluated and ranked in {ev.seconds:.1f} s with "
          f"{args.workers} worker(s) ({rate:,.0f} plans/s, {rate / args.workers:,.0f} per "
          f"core); {ev.fit:,} fit in memory", flush=True)
    top = ev.candidates[:args.top]
    rows, est, sim = [], [], []
    for k, c in enumerate(top, start=1):
        t0 = time.perf_counter()
        s = simulate_candidate(model, base, c, cost).summary
        est.append(c.step_time_s)
        sim.append(s.step_time_s)
        rows.append({"rank": k, "plan": plan_label(c.plan), "estimate_s": c.step_time_s,
                     "twin_s": s.step_time_s, "peak_memory_bytes": s.peak_memory_max_bytes,
                     "mfu": s.mfu, "sim_wall_s": time.perf_counter() - t0})
        print(f"  {k:>2}. {plan_label(c.plan):<58} estimate {c.step_time_s:8.3f} s  twin "
              f"{s.step_time_s:8.3f} s ({c.step_time_s / s.step_time_s - 1:+.1%})  MFU "
              f"{s.mfu:.1%}", flush=True)
    top_check = agreement(est, sim) if top else None
    if top_check:
        print(f"top {len(top)}: the estimate's choice is {top_check['regret']:.2%} slower than the "
              f"best simulated (target <= 3%); Spearman {_rho(top_check)}; |error| "
              f"median {top_check['median_abs_error']:.1%}, largest "
              f"{top_check['max_abs_error']:.1%}", flush=True)
    rng = random.Random(0)
    sample = rng.sample(ev.candidates, min(args.sample, len(ev.candidates)))
    se = [c.step_time_s for c in sample]
    ss = [simulate_candidate(model, base, c, cost).summary.step_time_s for c in sample]
    sample_rows = [{"plan": plan_label(c.plan), "estimate_s": e, "twin_s": s}
                   for c, e, s in zip(sample, se, ss)]
    sample_check = agreement(se, ss) if sample else None
    if sample_check:
        print(f"random sample of {len(sample)} plans that fit: Spearman "
              f"{_rho(sample_check)}; |error| median "
              f"{sample_check['median_abs_error']:.1%}, largest "
              f"{sample_check['max_abs_error']:.1%}", flush=True)
    return {"model": model_name, "cluster": cluster_name, "gpus": gpus, "global_batch_size": gbs,
            "profile": cost.name, "evaluated": ev.evaluated, "fit": ev.fit,
            "seconds": ev.seconds, "workers": args.workers,
            "plans_per_s": rate, "top": rows, "top_agreement": top_check,
            "sample": sample_rows, "sample_agreement": sample_check}


def a100_regret(args) -> dict:
    rows = jobs_from_runs(DATA / "step_times_1node.csv", column_map("vtrain_a100"))
    cluster = rows[0].job.cluster
    cost = load_profile("dgx_a100", cluster)
    est = Estimator(cost)
    print(f"\n== A100 measured set: {len(rows)} runs, profile {cost.name} ==", flush=True)
    groups: dict = defaultdict(list)
    for r in rows:
        j = r.job
        model = f"h{j.model.hidden_size}-L{j.model.num_layers}"
        groups[(model, j.grid.world_size, j.parallel.global_batch_size)].append(r)
    t0 = time.perf_counter()
    per_model: dict = defaultdict(lambda: {"search": [], "estimate": [], "twin": []})
    dropped = simulated = 0
    for (model, _, _), rs in sorted(groups.items()):
        if len(rs) < 2:
            continue
        best = min(r.run.step_time_s for r in rs)
        fits = [r for r in rs if peak_memory(r.job).fits(r.job.cluster.hbm_bytes)]
        dropped += len(rs) - len(fits)
        scored = sorted(((est(r.job).step_time_s, r) for r in fits), key=lambda x: x[0])
        twin = {id(r): simulate(r.job, cost, SimOptions(fold="all")).summary.step_time_s
                for r in rs}
        simulated += len(rs)
        top = [r for _, r in scored[:args.top]]
        pick = min(top, key=lambda r: twin[id(r)])
        per_model[model]["search"].append(pick.run.step_time_s / best - 1)
        per_model[model]["estimate"].append(scored[0][1].run.step_time_s / best - 1)
        twin_pick = min(rs, key=lambda r: twin[id(r)])
        per_model[model]["twin"].append(twin_pick.run.step_time_s / best - 1)
    out = {}
    print(f"{'model':<12} {'groups':>6}  {'search: mean':>12} {'max':>7}  {'estimate: mean':>14} "
          f"{'max':>7}  {'twin (all): mean':>16} {'max':>7}")
    for model, d in sorted(per_model.items()):
        out[model] = {k: {"mean": statistics.mean(v), "max": max(v)} for k, v in d.items()}
        out[model]["groups"] = len(d["search"])
        print(f"{model:<12} {len(d['search']):>6}  {statistics.mean(d['search']):>12.2%} "
              f"{max(d['search']):>7.2%}  {statistics.mean(d['estimate']):>14.2%} "
              f"{max(d['estimate']):>7.2%}  {statistics.mean(d['twin']):>16.2%} "
              f"{max(d['twin']):>7.2%}", flush=True)
    every = [x for d in per_model.values() for x in d["search"]]
    print(f"all {len(every)} groups: the search's choice is {statistics.mean(every):.2%} slower "
          f"than the measured best on average (largest {max(every):.2%}); {dropped} measured "
          f"runs the memory model says do not fit; {simulated} simulations in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    return {"rows": len(rows), "groups": len(every), "dropped_by_memory": dropped,
            "regret_by_model": out, "regret_mean": statistics.mean(every),
            "regret_max": max(every)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2, help="processes evaluating plans")
    ap.add_argument("--top", type=int, default=10, help="plans simulated per search (K)")
    ap.add_argument("--sample", type=int, default=10, help="random plans simulated per search")
    ap.add_argument("--only", choices=[*CASES, "a100"], help="run one part")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_search.json"))
    args = ap.parse_args()
    warnings.simplefilter("ignore")  # legal plans that warn (1F1B fill/drain) are searched too
    results = {}
    for name in CASES:
        if args.only in (None, name):
            results[name] = search_case(name, args)
    if args.only in (None, "a100"):
        if DATA.is_dir():
            results["a100_measured"] = a100_regret(args)
        else:
            print(f"the A100 measured set is not at {DATA}; skipped")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.only and out.exists():  # one part rerun: the other parts' figures are kept
        try:
            kept = json.loads(out.read_text())
        except ValueError:
            sys.exit(f"{out} is not this benchmark's JSON; give --out another file")
        results = {**kept, **results}
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(results, indent=2, default=float))
    tmp.replace(out)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
