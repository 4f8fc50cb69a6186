"""`paratwin search` as a user runs it: JSON with the ranked plans, the run directories and
the Pareto report, and one-line errors for searches that cannot work."""

from __future__ import annotations

import json

import pytest

from tests.cli.test_inspect_cli import paratwin
from twin.spec import ParallelPlan

pytestmark = pytest.mark.timeout(180)

TINY = ("model=tiny", "cluster=cpu_local", "cluster.gpus_per_node=4", "global_batch_size=8",
        "workers=1")


@pytest.mark.filterwarnings("ignore::twin.spec.ConfigWarning")  # a legal 1F1B fill/drain
def test_json_ranks_simulated_plans_and_writes_their_runs(tmp_path):
    out = paratwin("search", *TINY, "top=3", "pareto=1", "format=json",
                   f"out_dir={tmp_path / 's'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["evaluated"] >= res["fit"] > 0 and 3 <= res["simulated"] <= 4
    plans = res["plans"]
    assert len(plans) == res["simulated"]
    times = [p["step_time_s"] for p in plans]
    assert times == sorted(times)
    for p in plans:
        assert {"parallel", "step_time_s", "tokens_per_s", "mfu", "peak_memory_bytes"} <= set(p)
        plan = ParallelPlan(**p["parallel"])
        assert plan.dp * plan.tp * plan.pp == p["gpus"] == 4
        assert p["tokens_per_s"] == pytest.approx(8 * 64 / p["step_time_s"])
        summary = json.loads((tmp_path / "s" / p["run_dir"].split("/s/")[-1] /
                              "summary.json").read_text())
        assert summary["step_time_s"] == p["step_time_s"]
    saved = json.loads((tmp_path / "s" / "search.json").read_text())
    assert saved["plans"] == plans
    page = (tmp_path / "s" / "report.html").read_text()
    assert "Pareto front" in page and "runs/" in page


def test_top_zero_ranks_by_the_estimate_and_simulates_nothing(tmp_path):
    out = paratwin("search", *TINY, "top=0", "show=5", "out_dir=o", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "plans evaluated" in out.stdout and "ranked by the estimate (nothing simulated)" in out.stdout
    assert not (tmp_path / "o" / "runs").exists()
    res = json.loads((tmp_path / "o" / "search.json").read_text())
    assert res["simulated"] == 0 and len(res["plans"]) == 5
    assert all(p["source"] == "estimate" for p in res["plans"])


@pytest.mark.parametrize("args, text", [
    (("gpus=64", "global_batch_size=2"), "global_batch_size=2 cannot be split over any "
                                         "data-parallel degree"),
    (("cluster.num_nodes=null",), "no GPU count"),
    (("gpus=[5,7]",), "no GPU count to plan for"),
    (("cluster.gpu.hbm_GB=0.001",), "no plan fits in 1 MB per GPU: the smallest peak found is"),
    (("space.zero_stage=[5]",), "space.zero_stage: 5 is not one of 0|1|2|3"),
    (("space.tp=[3]",), "space.tp=[3] holds no legal tp"),
    (("gpus=[8,4]",), "the range is empty"),
])
def test_bad_searches_are_one_line_and_write_nothing(tmp_path, args, text):
    base = [a for a in TINY if not a.startswith("global_batch_size") or
            not any(x.startswith("global_batch_size") for x in args)]
    out = paratwin("search", *base, *args, cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    assert text in out.stderr
    assert list(tmp_path.iterdir()) == []



@pytest.mark.filterwarnings("ignore::twin.spec.ConfigWarning")
def test_a_plan_the_twin_fails_on_is_reported_and_the_rest_ranked(tmp_path, monkeypatch, capsys):
    """One simulation that raises does not end the search: the plan is listed as not
    simulated, with its error, and the others are ranked."""
    from hydra import compose, initialize_config_dir

    from paratwin.config import CONF_DIR, register_schemas
    from paratwin.verbs import search

    real, calls = search.simulate_candidate, []

    def flaky(*args, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("simulation ended with 2 collectives waiting: the schedule deadlocks")
        return real(*args, **kw)

    monkeypatch.setattr(search, "simulate_candidate", flaky)
    register_schemas()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="search", overrides=[*TINY, "top=3", "pareto=0",
                                                        f"out_dir={tmp_path / 's'}"])
    res = search.run(cfg)
    assert len(calls) == 3 and res["simulated"] == 2 and len(res["plans"]) == 2
    (failed,) = res["failed"]
    assert failed["error"].startswith("RuntimeError: simulation ended")
    assert "not simulated:" in capsys.readouterr().out
