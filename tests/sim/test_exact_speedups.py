"""The twin's speed-ups change no result: a folded, fast-forwarded step is the full
simulation's (every rank, every micro-batch) to within 0.1% on a dozen plans, its trace is
the full run's span for span, and the summary computed from the engine's arrays is the one
the spans give (twin/sim/flows.py, fastforward.py, stats.py)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from tests.conftest import gpt
from twin.metrics import summarize
from twin.schedule.builder import build_schedule
from twin.schedule.names import moved
from twin.sim import fastforward
from twin.sim.engine import SimOptions, Simulation, fold_classes
from twin.sim.fastforward import SHORT, find_cut, reduced_job, reduced_microbatches
from twin.sim.records import auto_fold, exact_axes
from twin.sim.run import simulate
from twin.spec import ClusterSpec, GPUSpec, InterNodeSpec, ParallelPlan, build_job

FULL = SimOptions(fold="none", fast_forward=False)
FAST = SimOptions(fold="auto")


def _cluster(nodes: int = 2, gpus: int = 8, nics: int = 8) -> ClusterSpec:
    return ClusterSpec(name="2n", num_nodes=nodes, gpus_per_node=gpus,
                       gpu=GPUSpec(peak_tflops={"bf16": 300.0}),
                       inter=InterNodeSpec(nics_per_node=nics, nic_bw_GBps=25.0))


def _job(plan: dict, nodes: int = 2, gpus: int = 8, nics: int = 8):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_job(gpt(), _cluster(nodes, gpus, nics), ParallelPlan(**plan))


# plan, cluster (nodes, GPUs per node, NICs), whether the steady state is fast-forwarded
PLANS = {
    "dp (DDP), accumulating": (dict(global_batch_size=256), (2, 8, 8), True),
    "zero1": (dict(zero_stage=1, global_batch_size=16), (2, 8, 8), False),
    "zero2, accumulating": (dict(zero_stage=2, global_batch_size=256), (2, 8, 8), True),
    "fsdp, tp2": (dict(zero_stage=3, tp=2, global_batch_size=8), (2, 8, 8), False),
    "tp4": (dict(tp=4, global_batch_size=8), (2, 8, 8), False),
    "tp4 + sp": (dict(tp=4, sp=True, global_batch_size=16), (2, 8, 8), False),
    "gpipe": (dict(pp=4, pp_schedule="gpipe", global_batch_size=16), (2, 4, 4), False),
    "1f1b": (dict(pp=4, global_batch_size=48), (2, 4, 4), True),
    "interleaved": (dict(pp=2, pp_schedule="interleaved", pp_virtual_stages=2,
                         global_batch_size=96), (2, 4, 4), True),
    # the first reduced run (12 of 32 micro-batches) holds 1.75 periods: too few for a window
    # and its copies, cut where its state repeats
    "interleaved, a short run": (dict(pp=4, pp_schedule="interleaved", pp_virtual_stages=2,
                                      global_batch_size=64), (2, 4, 4), True),
    "3d": (dict(tp=2, pp=2, sp=True, global_batch_size=128), (2, 4, 2), True),
    "3d + zero1, full recompute": (dict(tp=2, pp=2, zero_stage=1, recompute="full",
                                        global_batch_size=128), (2, 4, 4), True),
    "pp over nodes, one NIC": (dict(pp=4, tp=2, global_batch_size=48), (2, 4, 1), True),
    # FSDP kept gathered from a forward to a later backward, gradients reduced once (as
    # torchtitan runs FSDP under PP): buffers named by two micro-batches
    "fsdp under pp, unsharded": (dict(zero_stage=3, pp=4, fsdp_reshard_after_forward=False,
                                      grad_sync="last", global_batch_size=96), (2, 4, 4), True),
    # the two pipelines meet different links (one sends between nodes where the other does
    # not): each repeats with its own period, none with one period: simulated in full
    "pp=3 across 4-GPU nodes (dp unfolded)": (dict(tp=2, pp=3, pp_stage_layers=[3, 3, 2],
                                                   global_batch_size=48), (3, 4, 4), False),
}


@pytest.mark.parametrize("name", PLANS)
def test_folded_and_fast_forwarded_steps_equal_the_full_simulation(name):
    plan, shape, forwarded = PLANS[name]
    job = _job(plan, *shape)
    full = simulate(job, options=FULL, trace="none").summary
    fast = simulate(job, options=FAST, trace="none").summary
    assert fast["step_time_s"] == pytest.approx(full["step_time_s"], rel=1e-3)
    assert full["simulated_ranks"] == job.grid.world_size
    assert fast["simulated_ranks"] < full["simulated_ranks"]  # folding took place
    assert (fast["fast_forward"] is not None) == forwarded
    if forwarded:
        ff = fast["fast_forward"]
        assert ff["simulated_microbatches"] < ff["microbatches"] == job.parallel.num_microbatches
    for key in ("bubble_fraction", "mfu", "peak_memory_max_bytes"):
        assert fast[key] == pytest.approx(full[key], rel=1e-6, abs=1e-12), key
    for key in ("compute_s", "idle_s", "peak_memory_bytes"):
        for rank, value in fast[key].items():  # every simulated rank is summarized
            assert value == pytest.approx(full[key][rank], rel=1e-6, abs=1e-12), (key, rank)
    for group, value in full["exposed_comm_s"].items():
        assert fast["exposed_comm_s"][group] == pytest.approx(value, rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("name", ["1f1b", "interleaved", "interleaved, a short run",
                                  "3d + zero1, full recompute",
                                  "fsdp under pp, unsharded"])
def test_a_fast_forwarded_trace_is_the_full_runs_span_for_span(name):
    plan, shape, _ = PLANS[name]
    job = _job(plan, *shape)
    full = simulate(job, options=FULL, trace="full")
    fast = simulate(job, options=FAST, trace="full")
    assert fast.summary["fast_forward"]["periods"] > 0
    ranks = set(fast.trace.meta["recorded_ranks"])
    want = {(s.rank, s.op): s for s in full.trace.spans if s.rank in ranks}
    got = {(s.rank, s.op): s for s in fast.trace.spans}
    assert len(got) == len(fast.trace.spans) and set(got) == set(want)
    step = full.summary["step_time_s"] * 1e6
    for key, s in got.items():
        w = want[key]
        assert (s.mb, s.tag, s.kind) == (w.mb, w.tag, w.kind)
        assert abs(s.start_us - w.start_us) <= 1e-9 * step and abs(s.end_us - w.end_us) <= 1e-9 * step
    parts, whole = fast.summary["critical_path_s"], full.summary["critical_path_s"]
    assert parts.keys() == whole.keys()
    for k in parts:
        assert parts[k] == pytest.approx(whole[k], rel=1e-6), k


def test_the_summary_from_the_engines_arrays_is_the_one_its_spans_give():
    job = _job(dict(tp=2, pp=2, sp=True, zero_stage=1, global_batch_size=16), 2, 4, 2)
    res = simulate(job, options=FULL, trace="full", steps=2)
    a, b = res.summary, summarize(res.trace, job)
    for key in ("step_time_s", "bubble_fraction", "mfu", "peak_memory_max_bytes", "steps"):
        assert a[key] == pytest.approx(b[key], rel=1e-9), key
    for key in ("compute_s", "idle_s", "peak_memory_bytes", "exposed_comm_s"):
        assert a[key].keys() == b[key].keys(), key
        for k in a[key]:
            assert a[key][k] == pytest.approx(b[key][k], rel=1e-9, abs=1e-15), (key, k)


def test_auto_folds_the_axes_whose_copies_meet_the_same_links():
    # 8 GPUs and 8 NICs a node: dp=8 spans both nodes, 4 a node, each a NIC of its own
    assert exact_axes(_job(dict(tp=2, global_batch_size=8))) == ("dp", "tp")
    # 2 NICs for 4 GPUs: moving one rank along dp swaps the ranks sharing a NIC
    assert exact_axes(_job(dict(global_batch_size=8), 2, 4, 2)) == ()
    # dp's stride (tp * pp = 6 ranks) cuts across 4-GPU nodes; tp=2 stays inside a node
    odd = _job(dict(tp=2, pp=3, pp_stage_layers=[3, 3, 2], global_batch_size=6), 3, 4, 4)
    assert exact_axes(odd) == ("tp",) and auto_fold(odd) == "tp"
    # a flat ring over nodes is not preserved by the moves inside a node
    assert exact_axes(_job(dict(global_batch_size=16)), algorithm="ring") == ()
    s = simulate(odd, options=FAST, trace="none").summary
    assert s["fold"] == "tp"
    assert any("leaves dp unfolded" in note for note in s["notes"])


def test_a_what_if_or_jitter_turns_folding_and_fast_forward_off_with_a_notice():
    job = _job(dict(pp=4, global_batch_size=48), 2, 4, 4)
    s = simulate(job, options=SimOptions(fold="auto", straggler={3: 2.0}), trace="none").summary
    assert s["fold"] == "none" and s["fast_forward"] is None
    assert any("simulates every rank" in n for n in s["notes"])
    assert any("fast-forward is off: a straggler" in n for n in s["notes"])
    base = simulate(job, options=FAST, trace="none").summary
    assert s["step_time_s"] > base["step_time_s"]


def test_the_same_op_later_names_every_micro_batch_later():
    assert moved("fwd/mb2/c0/alloc.act.embed.mb2", 28) == "fwd/mb30/c0/alloc.act.embed.mb30"
    assert moved("act.c0.mb21", 3) == "act.c0.mb24"
    assert moved("xmb2/mb_2", 3) == "xmb2/mb_2"
    # a buffer gathered in a forward, freed in an earlier micro-batch's backward (FSDP kept
    # unsharded under a pipeline): both micro-batches move
    assert moved("bwd/mb6/L3/free.gathered.3.fwd.mb11", 1) == "bwd/mb7/L3/free.gathered.3.fwd.mb12"


def _reduced_run(job, periods: float = 4):
    small = reduced_job(job, reduced_microbatches(job, periods))
    classes = fold_classes(small, "all")
    schedule = build_schedule(small)
    sim = Simulation(small, {r: schedule.program(r) for r in classes}, _cost(small),
                     SimOptions(fold="all"), classes)
    sim.run()
    return sim


def _cost(job):
    from twin.cost import default_cost_model

    return default_cost_model(job.cluster)


def test_a_cut_is_only_made_where_every_op_repeats_a_period_later():
    sim = _reduced_run(_job(dict(pp=4, global_batch_size=48), 2, 4, 4))
    cut, period = find_cut(sim, 1)
    assert 0 < period < cut
    # an op that starts in the period before the cut, moved by a microsecond: that period
    # no longer repeats, so no cut may keep it in its window
    rank = min(sim.programs)
    start, end = sim.start[rank], sim.end[rank]
    inside = [i for i in range(len(start)) if cut - period <= start[i] < cut and end[i] > start[i]]
    i = inside[len(inside) // 2]
    start[i] += 1e-6
    end[i] += 1e-6
    found = find_cut(sim, 1)
    assert found is None or not (found[0] - found[1] <= start[i] < found[0])


def test_a_reduced_run_too_short_to_hold_a_period_is_not_tried():
    # four micro-batches without a pipeline: the reduced run would have two, and the window
    # (1.1 periods) with its copies a period later needs three; the step is simulated once
    job = _job(dict(tp=2, global_batch_size=32))
    assert job.parallel.pp == 1 and job.parallel.num_microbatches == 4
    assert reduced_microbatches(job, 2) >= 3
    fast = simulate(job, options=SimOptions(fold="auto"), trace="none").summary
    whole = simulate(job, options=SimOptions(fold="auto", fast_forward=False), trace="none").summary
    assert fast["fast_forward"] is None and fast["events"] == whole["events"]
    assert fast["step_time_s"] == whole["step_time_s"]


def test_a_run_too_short_for_a_window_is_cut_where_its_state_repeats():
    job = _job(PLANS["interleaved, a short run"][0], 2, 4, 4)
    assert (job.parallel.num_microbatches, reduced_microbatches(job, SHORT)) == (32, 12)
    sim = _reduced_run(job, SHORT)
    d = job.parallel.pp
    lines, cps, copies = fastforward.run_lines(sim, d)
    step = max(float(e.max()) for _, e in lines.values())
    cut, period = find_cut(sim, d)
    bad = fastforward._bad_intervals(lines, cps, period, 1e-9 * step)
    assert fastforward._window(lines, cps, bad, period, 1e-9 * step, None) is None
    a = cut - period  # the state at a is the state at the cut, every op a period on
    lo = max(e for e in bad[1] if e < a)

    def repeats():
        return fastforward._state_repeats(lines, cps, copies, a, period, lo, 1e-9 * step, None)

    assert repeats()
    fast = simulate(job, options=FAST, trace="none").summary
    assert fast["fast_forward"]["simulated_microbatches"] == 12
    # an op of the first period still running at the cut: nothing before a stands for it
    rank = min(lines)
    s, e = lines[rank]
    c = cps[rank]
    head = next(i for i in range(len(s)) if not copies[rank][i] and c[i] >= 0 and e[i] > a)
    old = e[head]
    e[head] = cut + period / 100
    assert not repeats()
    e[head] = old
    assert repeats()
    # an op in flight at a whose counterpart ends a microsecond late: no state with it in
    # flight repeats
    i = next(i for i in range(len(s)) if s[i] < a < e[i] and c[i] >= 0)
    e[c[i]] += 1e-6
    found = find_cut(sim, d)
    assert found is None or not s[i] < found[0] - found[1] < e[i]


def test_no_state_is_looked_for_between_bad_ops_that_touch():
    # two ops that do not repeat, the second starting a rounding step after the first ends:
    # no instant lies between them (seed 4 of fold_fuzz: a 1F1B pipeline under ZeRO-2)
    one = np.nextafter(1.0, 2.0)
    s, e = np.array([0.0, np.nextafter(one, 2.0)]), np.array([one, 2.0])
    bad = (s, e)
    lines, cps, copies = {0: (s, e)}, {0: np.array([-1, -1])}, {0: np.zeros(2, dtype=bool)}
    assert fastforward._snapshot(lines, cps, copies, bad, 1.0, 1e-9, None) is None


def _short_programs(job):
    small = reduced_job(job, reduced_microbatches(job, SHORT))
    schedule = build_schedule(small)
    return {r: schedule.program(r) for r in fold_classes(small, "all")}, small


def test_the_shortest_run_is_skipped_for_programs_that_do_not_repeat_micro_batch_to_micro_batch():
    plain = _job(dict(pp=4, global_batch_size=48), 2, 4, 4)
    progs, small = _short_programs(plain)
    assert fastforward.regular(progs, 1, small.parallel.num_microbatches)
    # FSDP under a pipeline keeps its root module gathered through the warm-up's forwards
    # and gathers it anew for each forward after a backward: in 5 micro-batches, ops of
    # micro-batch 4 alone (and of the cool-down's backwards), not of the one before
    fsdp = _job(dict(pp=4, zero_stage=3, global_batch_size=96), 2, 4, 4)
    progs, small = _short_programs(fsdp)
    assert not fastforward.regular(progs, 1, small.parallel.num_microbatches)
    fast = simulate(fsdp, options=FAST, trace="none").summary
    assert fast["fast_forward"]["simulated_microbatches"] == reduced_microbatches(fsdp, 4)
    full = simulate(fsdp, options=FULL, trace="none").summary
    assert fast["step_time_s"] == pytest.approx(full["step_time_s"], rel=1e-9)


def test_a_skipped_shortest_run_is_still_tried_when_it_is_also_the_two_period_run(monkeypatch):
    # 12 micro-batches: the 4-period run (7) is past half, cut to 2 periods: 5, the shortest
    # run's count, which `regular` skipped for FSDP; it must be simulated then, as before
    from twin.sim import stepsim

    job = _job(dict(pp=4, zero_stage=3, global_batch_size=24), 2, 4, 4)
    assert job.parallel.num_microbatches == 12
    assert reduced_microbatches(job, SHORT) == reduced_microbatches(job, 2) == 5
    runs = []
    engine = stepsim.Stepper._engine

    def counted(self, small, options):
        runs.append(small.parallel.num_microbatches)
        return engine(self, small, options)

    monkeypatch.setattr(stepsim.Stepper, "_engine", counted)
    simulate(job, options=FAST, trace="none")
    assert runs[0] == 5
