"""Accuracy of the twin on 1,440 measured A100 training steps, cross-validated.

    python benchmarks/accuracy_a100.py [--rows N] [--folds 5] [--workers 2] [--write-profile]

The published set (../shared/reference/a100_measured: Megatron-DeepSpeed GPT on one
8 x A100 node, measured by the vTrain authors) is read with its column map
(conf/column_maps/vtrain_a100.yaml). Collectives come from its nccl-tests sweeps. Then:

1. before: the shipped dgx_a100 defaults on every row;
2. k-fold: the cost model fitted on k-1 folds (twin.calibrate.stepfit) predicts the held-out
   fold with the full simulator; every row is predicted once by a fit that never saw it;
3. a harder split: fitted on hidden 1024, predicting hidden 2048;
4. with --write-profile, the fit on every row is written to conf/profiles/dgx_a100.yaml;
   --profile-only does only that, with the cross-validated figures of an earlier run (--out).

Figures per split: mean, median and largest absolute error, Spearman's rank correlation
within each (hidden, layers) model (smallest and median), and the top-1 regret of picking
the predicted-fastest plan within each (model, GPUs, global batch) group. Results go to
benchmarks/results/accuracy_a100.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from paratwin.runs import column_map, jobs_from_runs  # noqa: E402
from twin.calibrate.accuracy import Scored, holdout, kfold, score  # noqa: E402
from twin.calibrate.nccl_tests import read_nccl_tests  # noqa: E402
from twin.calibrate.profile import fit_collectives  # noqa: E402
from twin.calibrate.stepfit import fit_start, fit_steps, predict  # noqa: E402
from twin.cost import default_cost_model  # noqa: E402

DATA = ROOT.parent / "shared" / "reference" / "a100_measured"
A100_MAMF = 271.2 / 312
"""The largest GEMMs' efficiency on A100 SXM: maximum achievable matmul 271.2 of 312 TFLOP/s
(BF16, torch 2.6.0+cu126, best shape 1024x10240x5120; stas00/ml-engineering
compute/accelerator/README.md, 'Maximum Achievable Matmul FLOPS comparison table'). The set's
models (hidden <= 2048) cannot tell how large GEMMs run: the fit holds this ceiling and fits
how efficiency rises with size."""


def model_key(job):
    return f"h{job.model.hidden_size}-L{job.model.num_layers}"


def group_key(job):
    return (model_key(job), job.cluster.gpus_per_node, job.parallel.global_batch_size)


def scored(rows, paths):
    return [Scored(model_key(r.job), group_key(r.job), r.run.step_time_s, p.step_s)
            for r, p in zip(rows, paths)]


def line(name: str, s: dict) -> str:
    return (f"{name:<34} {s['rows']:>5} {s['mean_abs_error']:>7.1%} {s['median_abs_error']:>7.1%} "
            f"{s['max_abs_error']:>7.1%} {s['spearman_min']:>7.3f} {s['spearman_median']:>7.3f} "
            f"{s['regret_mean']:>7.1%} {s['regret_max']:>7.1%} {s['too_fast']:>5}")


HEAD = (f"{'split':<34} {'rows':>5} {'mean':>7} {'median':>7} {'max':>7} {'rho min':>7} "
        f"{'rho med':>7} {'regret':>7} {'reg max':>7} {'fast':>5}")


def write_profile(rows, start, workers, cv, cluster, log, results) -> None:
    """Fit every row and write conf/profiles/dgx_a100.yaml with ``cv``'s figures."""
    print("fitting on every row for conf/profiles/dgx_a100.yaml ...", flush=True)
    fit = fit_steps([r.job for r in rows], [r.run.step_time_s for r in rows], start,
                    workers=workers, log=log, gemm_ceiling=A100_MAMF)
    prov = {"source": "measured A100 steps (vTrain, ../shared/reference/a100_measured): "
                      "Megatron-DeepSpeed GPT, fp16, full recompute, 1F1B, one node",
            "cluster": cluster.name, "gpus": [cluster.gpu.name], "backend": "nccl",
            "rows": len(rows), "fit_seconds": round(fit.seconds, 1),
            "cross_validated": {k: cv[k] for k in ("mean_abs_error", "median_abs_error",
                                                   "max_abs_error", "spearman_min",
                                                   "regret_mean", "regret_max")},
            "benchmark": "python benchmarks/accuracy_a100.py --write-profile"}
    prof = dataclasses.replace(fit.cost, name="dgx_a100", provenance=prov)
    path = prof.save(ROOT / "conf" / "profiles" / "dgx_a100.yaml")
    results["profile"] = {"path": str(path), "params": fit.params,
                          "shape_factors": len(fit.cost.shape_factors), "seconds": fit.seconds}
    print(f"wrote {path}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=0, help="use the first N rows (0: all)")
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--write-profile", action="store_true")
    ap.add_argument("--profile-only", action="store_true",
                    help="only fit every row and write the profile (figures from --out's last run)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "accuracy_a100.json"))
    args = ap.parse_args()
    if not DATA.is_dir():
        sys.exit(f"the A100 set is not at {DATA}")
    t0 = time.perf_counter()
    rows = jobs_from_runs(DATA / "step_times_1node.csv", column_map("vtrain_a100"))
    if args.rows:
        rows = rows[: args.rows]
    cluster = rows[0].job.cluster
    nccl = [r for f in sorted(DATA.glob("nccl_allreduce_*gpu.csv")) for r in read_nccl_tests(f)]
    cfits, _ = fit_collectives(nccl)
    shipped = default_cost_model(cluster)
    start = fit_start(dataclasses.replace(shipped, name="dgx_a100", collective_fits=cfits),
                      cluster.gpu.sm_count, p2p_host_sync=True)
    log = lambda m: print(f"  {m}", flush=True)  # noqa: E731
    print(f"{len(rows)} measured rows; collectives from {len(nccl)} nccl-tests points", flush=True)
    if args.profile_only:
        results = json.loads(Path(args.out).read_text())
        write_profile(rows, start, args.workers, results["kfold"], cluster, log, results)
        Path(args.out).write_text(json.dumps(results, indent=2, default=float))
        return
    results: dict = {"rows": len(rows)}
    print("before: the shipped dgx_a100 defaults ...", flush=True)
    before = score(scored(rows, predict([r.job for r in rows], shipped, args.workers)))
    results["before"] = before
    print(HEAD + "\n" + line("shipped defaults (before)", before), flush=True)

    preds = [None] * len(rows)
    fits = []
    for k, test in enumerate(kfold(len(rows), args.folds, seed=0)):
        test_set = set(test.tolist())
        train = [r for i, r in enumerate(rows) if i not in test_set]
        print(f"fold {k + 1}/{args.folds}: fitting on {len(train)} rows ...", flush=True)
        fit = fit_steps([r.job for r in train], [r.run.step_time_s for r in train], start,
                        workers=args.workers, log=log, gemm_ceiling=A100_MAMF)
        fits.append({"params": fit.params, "seconds": fit.seconds, "rounds": fit.rounds})
        for i, p in zip(test, predict([rows[i].job for i in test], fit.cost, args.workers)):
            preds[i] = p
    cv = score(scored(rows, preds))
    results["kfold"] = {"folds": args.folds, **cv, "fits": fits}
    print(HEAD + "\n" + line(f"{args.folds}-fold cross-validated", cv), flush=True)

    tr, te = holdout([r.job for r in rows], lambda j: j.model.hidden_size == 2048)
    print(f"hidden 1024 -> 2048: fitting on {len(tr)} rows ...", flush=True)
    fit = fit_steps([rows[i].job for i in tr], [rows[i].run.step_time_s for i in tr], start,
                    workers=args.workers, log=log, gemm_ceiling=A100_MAMF)
    hard = score(scored([rows[i] for i in te], predict([rows[i].job for i in te], fit.cost,
                                                      args.workers)))
    results["hidden_1024_to_2048"] = {**hard, "params": fit.params, "seconds": fit.seconds}
    print(HEAD + "\n" + line("fit h1024, predict h2048", hard), flush=True)

    if args.write_profile:
        write_profile(rows, start, args.workers, cv, cluster, log, results)
    results["seconds"] = time.perf_counter() - t0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2, default=float))
    print(f"done in {results['seconds'] / 60:.1f} min; {args.out}")


if __name__ == "__main__":
    main()
