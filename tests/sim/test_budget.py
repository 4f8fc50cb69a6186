"""Work budgets: the twin estimates ranks and work from the job's shape, refuses runaway
jobs in one line (estimate, budget, fix) before building anything per rank, and shows
progress while it sets up; the simulate verb writes nothing for a refused job."""

from __future__ import annotations

import json
import time

import pytest

from tests.conftest import cluster, gpt
from twin.schedule.builder import build_schedule
from twin.sim import run as simrun
from twin.sim.engine import SimOptions, fold_classes
from twin.sim.run import MAX_RANKS, MAX_WORK, check_budget, estimate_work, simulate
from twin.spec import ConfigError, ParallelPlan, build_job

HUGE = 10_000_000


def _job(nodes: int = 1, **plan):
    return build_job(gpt(), cluster(nodes=nodes), ParallelPlan(**plan))


@pytest.mark.parametrize("plan", [dict(), dict(zero_stage=3), dict(zero_stage=1),
                                  dict(tp=2, sp=True), dict(pp=2, global_batch_size=32),
                                  dict(tp=2, pp=2, global_batch_size=64, recompute="full"),
                                  dict(pp=2, pp_schedule="interleaved", pp_virtual_stages=2,
                                       global_batch_size=32)])
def test_the_ops_estimate_is_within_a_factor_of_two(plan):
    job = _job(**plan)
    schedule = build_schedule(job)
    actual = max(len(schedule.program(job.grid.rank(pp=s)).ops) for s in range(job.parallel.pp))
    est = estimate_work(job).ops_per_rank
    assert actual / 2 <= est <= 2 * actual


@pytest.mark.parametrize("fold", ["none", "dp", "tp", "all"])
def test_simulated_ranks_are_counted_without_folding(fold):
    job = _job(nodes=2, tp=2, pp=2, global_batch_size=16)
    assert estimate_work(job, fold).simulated_ranks == len(fold_classes(job, fold))


def test_ten_million_nodes_are_refused_at_once_with_the_estimate_and_the_fix():
    job = build_job(gpt(), cluster(nodes=HUGE), ParallelPlan(zero_stage=3))
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        simulate(job, options=SimOptions(fold="all"))
    assert time.perf_counter() - t0 < 5  # nothing was built per rank
    msg = str(err.value)
    assert msg.startswith(f"this job is too big to simulate: 80,000,000 GPUs (budget "
                          f"{MAX_RANKS:,}) and about ")
    assert "work units (budget 50 million, minutes: 1 rank simulated with fold=all" in msg
    assert msg.endswith("; use fewer nodes (cluster.num_nodes=10,000,000)")
    assert "\n" not in msg


def test_ten_million_micro_batches_are_refused_naming_the_batch():
    job = _job(global_batch_size=8 * HUGE)
    assert job.parallel.num_microbatches == HUGE
    with pytest.raises(ConfigError) as err:
        check_budget(job, "none")
    msg = str(err.value)
    assert "8 ranks simulated with fold=none x ~" in msg and "(budget 50 million" in msg
    assert msg.endswith("; use fewer micro-batches (parallel.global_batch_size=80,000,000 is "
                        "10,000,000 micro-batches per pipeline)")


def test_fold_all_is_suggested_when_it_brings_the_job_under_the_budget():
    job = _job(nodes=1024, zero_stage=3)  # 8,192 ranks unfolded
    with pytest.raises(ConfigError, match=r"; use fold=all \(simulates each copy once\) or "
                                          r"fewer nodes \(cluster.num_nodes=1,024\)$"):
        check_budget(job, "none")
    assert check_budget(job, "all").units < MAX_WORK / 10


def test_steps_count_and_are_named_in_the_fix():
    job = _job(nodes=64)  # 512 ranks unfolded: under the budget for one step
    one = check_budget(job, "none", steps=1)
    assert estimate_work(job, "none", steps=3).units == 3 * one.units - 2 * one.laid_out
    with pytest.raises(ConfigError) as err:
        check_budget(job, "none", steps=10_000)
    assert " x 10,000 steps, plus ~" in str(err.value)
    assert str(err.value).endswith("or fewer steps (steps=10,000)")


def test_legacy_dp_cannot_fold_dp_and_says_so_as_a_config_error():
    job = _job(legacy_dp=True)
    with pytest.raises(ConfigError, match="fold=dp cannot fold legacy DP: device 0 differs "
                                          "from the others; use fold=none"):
        simulate(job, options=SimOptions(fold="dp"))


def test_the_documented_jobs_are_well_under_the_budgets():
    """benchmarks/bench_twin.py's Llama jobs (8 GPUs, 1,024 unfolded, 16,384 folded)."""
    from benchmarks.bench_twin import JOBS
    from benchmarks.presets import dgx_h100, llama3

    for name, nodes, plan, fold in JOBS.values():
        w = check_budget(build_job(llama3(name), dgx_h100(nodes), plan), fold)
        assert w.world <= MAX_RANKS / 16 and w.units <= MAX_WORK / 4, (name, w)


def test_setup_reports_progress():
    seen = []
    simulate(_job(nodes=2), progress=lambda done, total, what: seen.append(what))
    assert {"folding ranks", "building programs", "setting up step 1/1"} <= set(seen)


def test_every_stage_of_a_fast_forwarded_step_is_reported_in_order():
    """After the engine has run, the stages without a count (total None) say what the step
    is doing: the steady state, the periods added, the critical path, the spans."""
    seen = []
    job = _job(pp=2, global_batch_size=32)
    res = simulate(job, progress=lambda done, total, what: seen.append((what, done, total)))
    assert res.summary["fast_forward"] is not None
    stages = list(dict.fromkeys(what for what, *_ in seen))
    n, ranks = res.summary["fast_forward"]["periods"], len(res.trace.meta["recorded_ranks"])
    counted = ["folding ranks", "building programs", "preparing step 1/1"]
    stages_only = ["setting up step 1/1", "finding the steady state of step 1/1",
                   f"adding {n} steady period(s) to step 1/1", "critical path of step 1/1",
                   f"recording the spans of {ranks} rank(s)"]
    want = counted[:2] + stages_only[:1] + counted[2:] + stages_only[1:]
    assert [s for s in stages if s in want] == want  # (simulating: every 4,096 ops of a stream)
    assert all(total is None for what, _, total in seen if what in stages_only)
    assert all(total > 0 and 0 <= done <= total for what, done, total in seen if what in counted)


def test_the_budget_is_a_parameter_of_the_check(monkeypatch):
    job = _job()
    need = estimate_work(job).units
    check_budget(job, max_work=need)
    with pytest.raises(ConfigError, match=f"budget {need - 1:,}"):
        check_budget(job, max_work=need - 1)
    monkeypatch.setattr(simrun, "MAX_RANKS", 4)
    with pytest.raises(ConfigError, match=r"8 GPUs \(budget 4\)"):
        simulate(job)


# -- the simulate verb: nothing written for a refused job; the run directory's owner ------

def test_the_cli_refuses_runaway_jobs_in_one_line_and_writes_nothing(tmp_path):
    from tests.cli.test_inspect_cli import paratwin

    out_dir = tmp_path / "r"
    t0 = time.perf_counter()
    out = paratwin("simulate", "cluster=dgx_h100", f"cluster.num_nodes={HUGE}", "report=false",
                   f"out_dir={out_dir}", cwd=tmp_path)
    assert time.perf_counter() - t0 < 30
    assert out.returncode == 2 and "Traceback" not in out.stderr
    (line,) = out.stderr.splitlines()
    assert line.startswith("paratwin simulate: config error: this job is too big to simulate: "
                           "80,000,000 GPUs (budget 262,144)")
    assert line.endswith("use fewer nodes (cluster.num_nodes=10,000,000)")
    assert not out_dir.exists()


def _run_verb(tmp_path, *overrides):
    from hydra import compose, initialize_config_dir

    from paratwin.config import CONF_DIR, register_schemas
    from paratwin.verbs import simulate as verb

    register_schemas()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="simulate", overrides=[
            "model=tiny", "cluster=cpu_local", "report=false", "format=json", *overrides])
    return verb.run(cfg)


def test_the_verb_claims_its_run_directory_and_keeps_a_foreign_trace(tmp_path, capsys):
    from twin import rundir

    mine = tmp_path / "mine"
    _run_verb(tmp_path, f"out_dir={mine}")
    capsys.readouterr()
    assert rundir.owner(mine) == "simulate" and (mine / "trace.json").is_file()
    # a run directory another verb wrote is refused, its files untouched
    theirs = tmp_path / "theirs"
    rundir.claim(theirs, "execute")
    (theirs / "summary.json").write_text('{"keep": 1}')
    with pytest.raises(ValueError, match="written by `paratwin execute`"):
        _run_verb(tmp_path, f"out_dir={theirs}")
    assert json.loads((theirs / "summary.json").read_text()) == {"keep": 1}
    # trace.json that is a paratwin trace: the Chrome export goes beside it
    kept = (mine / "spans.json").read_text()
    (mine / "trace.json").write_text(kept)
    _run_verb(tmp_path, f"out_dir={mine}")
    assert (mine / "trace.json").read_text() == kept
    assert json.loads((mine / "chrome_trace.json").read_text())["traceEvents"]
