"""`paratwin search`: every legal plan of a model on a cluster, pruned by memory, ranked by a
fast estimate; the best simulated with the full twin, a ranked table and a Pareto report."""

from __future__ import annotations

import json
import re
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import yaml
from omegaconf import OmegaConf

from paratwin.config import SPECS, load_profile, to_spec
from paratwin.outdir import out_dir
from paratwin.progress import Progress
from twin import rundir
from twin.files import write_json_atomic, write_text_atomic
from twin.search import SearchSpace, agreement, evaluate, gpu_counts
from twin.search.check import candidate_job, simulate_candidate
from twin.search.pareto import pareto_front, spread
from twin.search.space import SEARCHED
from twin.search.table import format_table, no_fit_message, plan_fields, plan_label
from twin.spec import ConfigError, ConfigWarning, ParallelPlan
from twin.spec.io import job_to_dict
from twin.spec.parallel import PP_SCHEDULES, RECOMPUTE, ZERO_STAGES

OUTPUTS = ("config.yaml", "search.json", "report.html", "runs")
CHOICES = {"tp": int, "pp": int, "micro_batch_size": int, "pp_virtual_stages": int, "sp": bool,
           "fsdp_reshard_after_forward": bool, "zero_stage": ZERO_STAGES,
           "pp_schedule": PP_SCHEDULES, "recompute": RECOMPUTE, "rank_order": str, "ep": int,
           "etp": int, "cp": int, "dp_replicate": int}


def _whole(value, field: str, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{field}={value!r} must be a whole number >= {low}")
    return value


def _choices(value, field: str, kind) -> tuple | None:
    """A field of ``space``: null, one value or a list, each checked."""
    if value is None:
        return None
    values = list(value) if OmegaConf.is_list(value) or isinstance(value, (list, tuple)) \
        else [value]
    if not values:
        raise ConfigError(f"space.{field}=[] holds no choice; give values or null (every one)")
    for v in values:
        if isinstance(kind, tuple):
            if v not in kind:
                raise ConfigError(f"space.{field}: {v!r} is not one of {'|'.join(map(str, kind))}")
        elif kind is int:
            _whole(v, f"space.{field}")
        elif kind is bool and not isinstance(v, bool):
            raise ConfigError(f"space.{field}: {v!r} must be true or false")
        elif kind is str:
            try:
                ParallelPlan(rank_order=str(v))
            except ValueError as err:
                raise ConfigError(str(err).replace("parallel.rank_order", "space.rank_order")) \
                    from None
    return tuple(str(v) if kind is str else v for v in values)


def space_from_cfg(cfg, cluster, base: ParallelPlan) -> SearchSpace:
    """The search space of the config (GPU counts, global batch, per-field choices)."""
    gpn = cluster.gpus_per_node
    gpus = cfg.get("gpus")
    if gpus is None:
        counts = [cluster.world_size]
    elif OmegaConf.is_list(gpus) or isinstance(gpus, (list, tuple)):
        if len(gpus) != 2:
            raise ConfigError(f"gpus={list(gpus)} must be one count or a range [LO, HI]")
        lo, hi = (_whole(g, "gpus") for g in gpus)
        if lo > hi:
            raise ConfigError(f"gpus=[{lo},{hi}]: the range is empty (LO > HI); write [{hi},{lo}]")
        counts = gpu_counts(cluster, lo, hi)
    else:
        n = _whole(gpus, "gpus")
        if n % gpn and gpn % n:
            raise ConfigError(f"gpus={n} is neither whole nodes of cluster.gpus_per_node={gpn} "
                              f"nor part of one node; use a multiple of {gpn} or a divisor of it")
        counts = [n]
    gbs = cfg.get("global_batch_size")
    if gbs is not None and base.global_batch_size not in (None, gbs):
        warnings.warn(f"parallel.global_batch_size={base.global_batch_size} is not used: every "
                      f"plan is searched at global_batch_size={gbs}", ConfigWarning, stacklevel=2)
    gbs = base.global_batch_size if gbs is None else gbs
    if gbs is None:
        raise ConfigError("no global batch size: set global_batch_size=N (sequences per step; "
                          "every plan is compared at the same batch)")
    node = cfg.get("space") or {}
    kw = {f: _choices(node.get(f), f, kind) for f, kind in CHOICES.items()}
    mmb = _whole(node.get("max_micro_batch_size", 16), "space.max_micro_batch_size")
    return SearchSpace(gpus=tuple(counts), global_batch_size=gbs, max_micro_batch_size=mmb,
                       gpus_per_node=gpn, base=base, **kw)


def specs_from_cfg(cfg):
    """Model, cluster and the base plan (the fields the search does not vary)."""
    cluster_node = cfg.get("cluster")
    if cluster_node is not None and cluster_node.get("num_nodes") is None:
        if cfg.get("gpus") is None:
            raise ConfigError("no GPU count: cluster.num_nodes is null and gpus is not set; set "
                              "cluster.num_nodes=N or gpus=N (or a range gpus=[LO,HI])")
        cluster_node = OmegaConf.merge(cluster_node, {"num_nodes": 1})
    model = to_spec(SPECS["model"], cfg.get("model"), "model")
    cluster = to_spec(SPECS["cluster"], cluster_node, "cluster")
    node = OmegaConf.to_container(cfg.get("parallel") or {}, resolve=True)
    defaults = ParallelPlan()
    for field in SEARCHED:
        if field in node and node[field] != getattr(defaults, field):
            warnings.warn(f"parallel.{field}={node[field]} is searched, not fixed; set "
                          f"space.{field}=[{str(node[field]).lower()}] to fix it", ConfigWarning,
                          stacklevel=2)
    base = to_spec(ParallelPlan, {k: v for k, v in node.items()
                                  if k not in (*SEARCHED, "dp", "dp_shard")}, "parallel")
    return model, cluster, base


def _sim(args) -> tuple[dict | None, str | None]:
    """Simulate one candidate and write its run directory (in a worker process)."""
    model, cluster, cand, cost, run, trace, report = args
    try:
        result = simulate_candidate(model, cluster, cand, cost)
    except Exception as err:  # noqa: BLE001 - one plan the twin fails on is reported, not fatal
        return None, f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    job = candidate_job(model, cluster, cand)
    rundir.claim(run, "search", outputs=("summary.json",))
    write_text_atomic(run / rundir.CONFIG, yaml.safe_dump(job_to_dict(job), sort_keys=False))
    summary = dict(result.summary.to_dict(), out_dir=str(run))
    write_json_atomic(run / rundir.SUMMARY, summary)
    if trace:
        result.trace.save(run / rundir.TRACE)
        if report:
            from twin.report import write_report

            write_report([run], traces={run: result.trace.as_saved()})
    return summary, None


def _slug(plan) -> str:
    """A plan's label as a directory name: 'tp4-pp2-dp8-fsdp-interleaved-v4-mb1-tp-cp-dp-pp'."""
    return re.sub(r"[^A-Za-z0-9._]+", "-", plan_label(plan).replace("=", "")).strip("-")[:80]


def _row(cand, summary: dict | None, run: Path | None) -> dict:
    est = cand.estimate
    e = {"step_time_s": est.step_time_s, "tokens_per_s": est.tokens_per_s, "mfu": est.mfu,
         "peak_memory_bytes": cand.peak_memory_bytes, "bubble_s": est.bubble_s,
         "exposed_comm_s": est.exposed_comm_s}
    s = summary or {}
    return {"gpus": cand.gpus, "parallel": plan_fields(cand.plan), "label": plan_label(cand.plan),
            "source": "twin" if summary else "estimate",
            "step_time_s": s.get("step_time_s", est.step_time_s),
            "tokens_per_s": s.get("tokens_per_s", est.tokens_per_s),
            "mfu": s.get("mfu", est.mfu),
            "peak_memory_bytes": s.get("peak_memory_max_bytes", cand.peak_memory_bytes),
            "exposed_comm_s": s.get("exposed_comm_s", est.exposed_comm_s),
            "bubble_fraction": s.get("bubble_fraction", est.bubble_s / est.step_time_s),
            "estimate": e, "run_dir": str(run) if summary and run else None}


def run(cfg) -> dict:
    fmt = cfg.get("format", "text")
    if fmt not in ("text", "json"):
        raise ConfigError(f"format={fmt!r} is not one of text|json")
    top = _whole(cfg.get("top", 10), "top", 0)
    show = _whole(cfg.get("show", 20), "show", 1)
    front_k = _whole(cfg.get("pareto", 10), "pareto", 0)
    workers = _whole(cfg.get("workers") or 1, "workers")
    model, cluster, base = specs_from_cfg(cfg)
    space = space_from_cfg(cfg, cluster, base)
    cost = load_profile(cfg.get("calibration"), cluster)
    if base.compile:  # every plan compiled: the estimate prices what the twin simulates
        cost = cost.compiled()
    bar = Progress("paratwin search")
    ev = evaluate(model, cluster, space, cost, workers=workers, progress=bar.update)
    if not ev.candidates:
        bar.close()
        raise ConfigError(no_fit_message(model, space, cluster.hbm_bytes, ev.smallest))
    cands = ev.candidates
    points = [(c.estimate.tokens_per_s, c.gpus, c.peak_memory_bytes) for c in cands]
    front = pareto_front(points)
    chosen = list(range(min(top, len(cands))))
    chosen += [i for i in spread(front, points, front_k) if i not in chosen] if top else []
    summaries: dict[int, tuple[dict | None, str | None, Path]] = {}
    t_sim = time.perf_counter()
    what = f"{model.name}-{cluster.name}"
    out = rundir.claim(Path(str(cfg.out_dir)) if cfg.get("out_dir")
                       else out_dir(cfg, "search", what), "search",
                       bool(cfg.get("force", False)), outputs=OUTPUTS)
    write_text_atomic(out / rundir.CONFIG, OmegaConf.to_yaml(cfg, resolve=True))
    if chosen:
        width = len(str(len(chosen)))
        runs = {i: out / "runs" / f"{k:0{width}d}-{cands[i].gpus}g-{_slug(cands[i].plan)}"
                for k, i in enumerate(chosen, start=1)}
        args = [(model, cluster, cands[i], cost, runs[i], bool(cfg.get("trace", True)),
                 bool(cfg.get("run_reports", False))) for i in chosen]
        bar.update(0, len(chosen), "simulating the best plans")
        if workers > 1 and len(chosen) > 1:
            with ProcessPoolExecutor(min(workers, len(chosen))) as pool:
                for k, (i, res) in enumerate(zip(chosen, pool.map(_sim, args))):
                    summaries[i] = (*res, runs[i])
                    bar.update(k + 1, len(chosen), "simulating the best plans")
        else:
            for k, (i, a) in enumerate(zip(chosen, args)):
                summaries[i] = (*_sim(a), runs[i])
                bar.update(k + 1, len(chosen), "simulating the best plans")
    bar.close()
    result = _result(model, cluster, space, cost, ev, cands, front, summaries, show, out)
    result["simulate_s"] = time.perf_counter() - t_sim
    result["out_dir"] = str(out)
    write_json_atomic(out / "search.json", result)
    if cfg.get("report", True):
        from twin.report.search import write_search_report

        write_search_report(out / rundir.REPORT, result, cloud(cands, front))
    print(json.dumps(result, indent=2) if fmt == "json" else format_text(result))
    return result


def _result(model, cluster, space, cost, ev, cands, front, summaries, show, out) -> dict:
    done = {i: s for i, s in summaries.items() if s[0] is not None}
    ranked = sorted(done, key=lambda i: done[i][0]["step_time_s"])
    on_front = set(front)
    rows = [_row(cands[i], done[i][0], done[i][2]) for i in ranked]
    # the front of the simulated plans, by the twin's figures (the report's linked points)
    sim_front = set(pareto_front([(r["tokens_per_s"], r["gpus"], r["peak_memory_bytes"])
                                  for r in rows]))
    rows = [dict(r, pareto=k in sim_front) for k, r in enumerate(rows)]
    if not rows:  # nothing simulated (top=0, or every simulation failed): by the estimate
        rows = [dict(_row(c, None, None), pareto=i in on_front)
                for i, c in enumerate(cands[:show])]
    check = agreement([cands[i].step_time_s for i in ranked],
                      [done[i][0]["step_time_s"] for i in ranked]) if ranked else None
    return {
        "model": model.name, "cluster": cluster.name, "gpus": list(space.gpus),
        "global_batch_size": space.global_batch_size, "profile": cost.name,
        "evaluated": ev.evaluated, "fit": ev.fit, "simulated": len(done), "evaluate_s": ev.seconds,
        "hbm_bytes": cluster.hbm_bytes, "plans": rows,
        "failed": [{"parallel": plan_fields(cands[i].plan), "gpus": cands[i].gpus, "error": s[1]}
                   for i, s in summaries.items() if s[0] is None],
        "estimated": [dict(_row(c, None, None), pareto=i in on_front)
                      for i, c in enumerate(cands[:show])],
        "pareto": [dict(_row(cands[i], *((done[i][0], done[i][2]) if i in done
                                         else (None, None))), pareto=True)
                   for i in front[:200]],
        "agreement": check}


CLOUD = 3000
"""Plans the report draws as the estimate's cloud at most (the front, the best, a sample)."""


def cloud(cands, front: list[int]) -> list[tuple[float, int, float, str]]:
    """(tokens/s, GPUs, peak bytes, label) of the front, the 500 best and an even sample of
    the other plans that fit, by the estimate."""
    pick = set(front) | set(range(min(500, len(cands))))
    rest = [i for i in range(len(cands)) if i not in pick]
    step = max(1, len(rest) // max(1, CLOUD - len(pick)))
    pick |= set(rest[::step])
    return [(cands[i].estimate.tokens_per_s, cands[i].gpus, cands[i].peak_memory_bytes,
             plan_label(cands[i].plan)) for i in sorted(pick)]


def format_text(r: dict) -> str:
    tokens = r["global_batch_size"]
    gpus = "/".join(map(str, r["gpus"]))
    lines = [f"search {r['model']} on {r['cluster']}: {gpus} GPUs, global batch {tokens} sequences,"
             f" profile {r['profile']}",
             f"  {r['evaluated']:,} plans evaluated in {r['evaluate_s']:.1f} s: {r['fit']:,} fit in "
             f"{r['hbm_bytes'] / 1e9:.0f} GB; {r['simulated']} simulated with the full twin in "
             f"{r['simulate_s']:.1f} s"]
    a = r.get("agreement")
    if a and a["plans"] > 1:
        rho = f"Spearman {a['spearman']:.2f}, " if a.get("spearman") is not None else ""
        lines.append(f"  estimate vs twin on the {a['plans']} simulated: {rho}errors median "
                     f"{a['median_abs_error']:.1%}, largest {a['max_abs_error']:.1%}; the "
                     f"estimate's pick is {a['regret']:.1%} slower than the twin's best")
    for f in r["failed"]:
        lines.append(f"  not simulated: {plan_label(f['parallel'])}: {f['error']}")
    lines += ["", format_table(r), "",
              "  ranked by the twin's step time" + (" (* on the Pareto front: tokens/s vs GPUs vs "
                                                    "memory)" if r["simulated"] else "")
              if r["simulated"] else "  ranked by the estimate (nothing simulated)"]
    lines.append(f"  wrote {r['out_dir']}/search.json, report.html"
                 + (f" and runs/ ({r['simulated']} run director"
                    f"{'ies' if r['simulated'] > 1 else 'y'}; `paratwin report DIR` draws one)"
                    if r["simulated"] else ""))
    return "\n".join(lines)
