"""Differential fuzz of the twin's exact speed-ups: random plans, each simulated twice, as
`paratwin simulate` runs it (fold=auto, fast_forward=true) and with every rank and
micro-batch (fold=none, fast_forward=false); the step time and every rank's peak memory must
agree (to 1e-9 relative: both are exact, so only float rounding may differ).

    python benchmarks/fold_fuzz.py [--seed 1] [--plans 300] [--async-share 0.3] [--long]
                                   [--programs]

``--long``: 24-64 micro-batches per pipeline (the default draws 1-32): long steady states,
where the fast-forward's first, shortest reduced run is cut where its state repeats.

``--programs``: the builder's exact speed-up instead: each plan (its micro-batches times
four) has one rank per pipeline stage built twice, with stamped layer bodies and whole
actions (twin/schedule/stamp.py, actions.py; actions recorded however few micro-batches
follow) and by the generic code; the programs must be equal, op for op and field for field.

Plans: small GPT or MoE models on 1-16 nodes of 2-8 GPUs (one NIC per node or one per GPU),
tp, pp, cp, dp, ZeRO 0-3 and HSDP, every pipeline schedule, recompute, five rank orders,
torch.compile, async TP, EP with etp, uniform or skewed routing, and half the time three of
the plan's other knobs (CP method, FSDP options, grad sync, Float8, optimizer kernels and
dtype, ...), on the generic defaults or the dgx_h100 / dgx_a100 profiles. Prints how many
were simulated, folded and fast-forwarded, the errors (an exception other than a config the
plan cannot run) and every mismatch; exits 1 if there is any. Found so far: HSDP folded as
one rotation of dp, async TP's ring under a fold, MoE templates under async TP and with
etp = tp and dp inside tp, HSDP with a shard group of one (its replica all-reduce had no
dependency), a host sync reading a collective's end before its stream wrote it (seeds 1 and
2: the unfolded run resumed the host early; e7733eb).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paratwin.config import CONF_DIR, preset_cluster  # noqa: E402
from twin.cost import CostModel  # noqa: E402
from twin.schedule.ir import Op  # noqa: E402
from twin.sim.engine import SimOptions  # noqa: E402
from twin.sim.run import simulate  # noqa: E402
from twin.spec import ModelSpec, ParallelPlan, build_job  # noqa: E402
from twin.spec.errors import ConfigError  # noqa: E402
from twin.spec.moe import MoESpec  # noqa: E402

ORDERS = ("tp-cp-pp-dp", "tp-cp-pp-dp", "dp-tp-cp-pp", "tp-dp-cp-pp", "pp-tp-cp-dp")
SCHEDULES = ("1f1b", "interleaved", "gpipe", "zb_h1", "zb_v", "dualpipev")
SHAPES = ((1, 8), (2, 4), (4, 2), (2, 2), (1, 4), (4, 4), (8, 8), (2, 8), (16, 2))


def random_job(rng: random.Random, async_share: float, long: bool = False):
    """(job, profile name or None, description) of one random plan (None: not runnable);
    ``long``: 24-64 micro-batches per pipeline (times p when interleaved)."""
    nodes, gpn = rng.choice(SHAPES)
    nics = rng.choice((1, gpn))
    moe = rng.random() < 0.25
    kw = dict(name="fuzz", num_layers=rng.choice((2, 4, 8)), hidden_size=128, num_heads=8,
              num_kv_heads=rng.choice((8, 2)), ffn_hidden_size=512, vocab_size=1000,
              seq_len=rng.choice((64, 128)), activation="gelu", dtype="bf16")
    if moe:
        routing = rng.choice((dict(routing="uniform"), dict(routing="skewed", routing_skew=0.5)))
        kw.update(activation="swiglu", moe=MoESpec(num_experts=8, experts_per_token=2,
                                                   moe_ffn_hidden_size=256, first_k_dense=1,
                                                   **routing))
    tp, pp, cp = rng.choice((1, 2, 4)), rng.choice((1, 2, 4)), 1 if moe else rng.choice((1, 1, 2))
    world = nodes * gpn
    if world % (tp * pp * cp):
        return None
    dp = world // (tp * pp * cp)
    sched = rng.choice(SCHEDULES) if pp > 1 else "1f1b"
    per_pipe = rng.choice((24, 32, 48, 64) if long else (1, 2, 4, 8, 16, 32)) \
        * (pp if sched == "interleaved" else 1)
    plan = dict(tp=tp, pp=pp, cp=cp, sp=tp > 1 and rng.random() < 0.8,
                zero_stage=rng.choice((0, 1, 2, 3)), pp_schedule=sched,
                pp_virtual_stages=2 if sched == "interleaved" else 1,
                global_batch_size=dp * per_pipe, recompute=rng.choice(("none", "selective", "full")),
                rank_order=rng.choice(ORDERS), compile=rng.random() < 0.3)
    if plan["zero_stage"] == 3 and dp % 2 == 0 and rng.random() < 0.4:
        plan["dp_replicate"] = 2
    if plan["sp"] and rng.random() < async_share:
        plan.update(async_tp=True, compile=True)
    if moe:
        plan.update(ep=rng.choice((1, 2, 4)), etp=rng.choice((None, 1)))
    if rng.random() < 0.5:  # the plan's other knobs, each now and then
        extra = dict(cp_method=("ring", "allgather", "alltoall"), cp_load_balance=("headtail", "none"),
                     fsdp_reshard_after_forward=(True, False), fsdp_reduce_dtype=("fp32", "bf16"),
                     micro_batch_size=(1, 2), recompute=("op",), recompute_early_stop=(True,),
                     flash_attention=(True, False), grad_sync=("default", "last", "every"),
                     sp_norm_grad_sync=("none", "per_tensor", "coalesced"),
                     optimizer_kernels=("fused", "foreach"),
                     float8=("none", "tensorwise", "rowwise"), float8_fsdp_all_gather=(True,),
                     optimizer_dtype=("fp32", "bf16"), compile_loss=(True, False))
        for name in rng.sample(sorted(extra), 3):
            plan[name] = rng.choice(extra[name])
        if plan.get("micro_batch_size") == 2:
            plan["global_batch_size"] *= 2
    cluster = preset_cluster(rng.choice(("dgx_h100", "dgx_a100")))
    cluster = dataclasses.replace(cluster, num_nodes=nodes, gpus_per_node=gpn,
                                  inter=dataclasses.replace(cluster.inter, nics_per_node=nics))
    profile = rng.choice((None, "dgx_h100", "dgx_a100"))
    try:
        job = build_job(ModelSpec(**kw), cluster, ParallelPlan(**plan))
    except (ConfigError, ValueError):
        return None
    what = (f"{nodes}x{gpn} GPUs, {nics} NIC(s)/node, {'MoE' if moe else 'dense'}, "
            f"profile {profile or 'defaults'}: {plan}")
    return job, profile, what


def profiles() -> dict[str, CostModel]:
    """The profiles random_job names."""
    return {n: CostModel.load(CONF_DIR / "profiles" / f"{n}.yaml") for n in ("dgx_h100", "dgx_a100")}


def both_ways(job, cost) -> tuple[dict, dict]:
    """The summaries of ``job`` simulated with every rank and micro-batch, and as `simulate`
    runs it (fold=auto, fast-forward)."""
    full, fast = (simulate(job, cost, SimOptions(fold=f, fast_forward=ff), trace="none").summary
                  for f, ff in (("none", False), ("auto", True)))
    return full, fast


def programs_both_ways(job) -> tuple[int, list[int]]:
    """(actions stamped, the ranks whose programs differ) of one rank per stage of ``job``
    with four times its micro-batches, built stamped and by the generic code."""
    from twin.schedule import actions, stamp
    from twin.schedule.builder import build_schedule
    from twin.sim.fastforward import reduced_job

    job = reduced_job(job, 4 * job.parallel.num_microbatches)
    ranks = sorted(set(job.grid.group(0, "pp")))
    fields = [f.name for f in dataclasses.fields(Op)]
    stamped, stamp_action = [], actions.ActionStamper._stamp

    def counted(self, *args):
        stamped.append(args)
        return stamp_action(self, *args)

    built = {}
    saved = stamp.ENABLED, actions.AHEAD
    actions.AHEAD, actions.ActionStamper._stamp = 0, counted
    try:
        for on in (True, False):
            stamp.ENABLED = on
            schedule = build_schedule(job)
            built[on] = {r: [tuple(getattr(op, f) for f in fields) for op in schedule.program(r).ops]
                         for r in ranks}
    finally:
        (stamp.ENABLED, actions.AHEAD), actions.ActionStamper._stamp = saved, stamp_action
    return len(stamped), [r for r in ranks if built[True][r] != built[False][r]]


def count_cuts() -> dict[str, int]:
    """Count the cuts the fast-forward finds by each of its checks (twin/sim/fastforward.py;
    a reduced run's check may find none before one does)."""
    from twin.sim import fastforward

    counts = {"window": 0, "state": 0}

    def counted(f, key):
        def run(*args, **kwargs):
            found = f(*args, **kwargs)
            counts[key] += found is not None
            return found
        return run

    fastforward._window = counted(fastforward._window, "window")
    fastforward._snapshot = counted(fastforward._snapshot, "state")
    return counts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--plans", type=int, default=300)
    ap.add_argument("--async-share", type=float, default=0.3,
                    help="chance that a plan with SP runs async TP")
    ap.add_argument("--long", action="store_true",
                    help="24-64 micro-batches per pipeline: long steady states to fast-forward")
    ap.add_argument("--programs", action="store_true",
                    help="compare stamped and generic programs instead of simulating")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    rng = random.Random(args.seed)
    costs = profiles()
    cuts = count_cuts()
    done = folded = forwarded = 0
    errors, mismatches = [], []
    t0 = time.perf_counter()
    while done < args.plans:
        got = random_job(rng, args.async_share, args.long)
        if got is None:
            continue
        job, profile, what = got
        try:
            got = programs_both_ways(job) if args.programs else both_ways(job, costs.get(profile))
        except ConfigError:  # (what the plan cannot run, past build_job: the work budget)
            continue
        except Exception as e:  # noqa: BLE001 - reported, the fuzz goes on
            errors.append(f"{type(e).__name__}: {str(e)[:200]} ({what})")
            done += 1
            continue
        done += 1
        if args.programs:
            n, differ = got
            forwarded += n  # (the actions stamped)
            if differ:
                mismatches.append(f"ranks {differ} differ ({what})")
            continue
        full, fast = got
        folded += fast["simulated_ranks"] < job.grid.world_size
        forwarded += bool(fast["fast_forward"])
        rel = fast["step_time_s"] / full["step_time_s"] - 1
        peaks = fast["peak_memory_bytes"]
        if abs(rel) > 1e-9 or any(full["peak_memory_bytes"][r] != peaks[r] for r in peaks):
            mismatches.append(f"step {rel:+.2e} ({what})")
        if done % 50 == 0:
            print(f"  {done} plans, {time.perf_counter() - t0:.0f} s", flush=True)
    what = f"{forwarded} actions stamped" if args.programs else \
        f"{folded} folded, {forwarded} fast-forwarded ({cuts['window']} cut by a window that " \
        f"repeats, {cuts['state']} by a state that repeats)"
    print(f"{done} plans (seed {args.seed}): {what}, {len(errors)} errors, "
          f"{len(mismatches)} mismatches ({time.perf_counter() - t0:.0f} s)")
    for line in errors + mismatches:
        print("  " + line)
    return 1 if errors or mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
