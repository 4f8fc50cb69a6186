"""Each kind of report opened in headless Chromium: no JavaScript error, every figure drew its
traces, a screenshot saved; the big-trace timeline redraws its level of detail on zoom.

Skipped locally without chromium; with CI=true a missing chromium fails. Screenshots go to
$PARATWIN_SCREENSHOTS (default: the test's temporary directory).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from paratwin.verbs.report import bench_model
from twin.report import Options, write_report
from twin.report import rundir as rd
from twin.report.browser import Browser, find_chromium
from twin.report.timeline import idle_gaps, timed

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def browser():
    exe = find_chromium()
    if exe is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true but chromium is missing: .ci/run must install it "
                        "(apt-get install -y chromium)")
        pytest.skip("chromium is not installed (apt-get install -y chromium, or set "
                    "PARATWIN_CHROMIUM); the browser tests need it")
    with Browser(exe, timeout_s=120) as b:
        yield b


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    return Path(os.environ.get("PARATWIN_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))


def check_rendered(page, want: list[str]) -> dict:
    """No error; each figure drew every trace it has; the wanted figure kinds are there."""
    assert page.errors == [], page.errors
    figs = page.probe["figures"]
    for fid, f in figs.items():
        assert f["data"] == f["full"] > 0 and f["visible"] > 0, (fid, f)
        assert f["points"] > 0, (fid, f)
        assert f["svg"] >= f["full"] - f["gl"], (fid, f)  # every SVG trace has its group
        assert f["gl"] == 0 or f["canvas"] > 0, (fid, f)  # WebGL traces have their canvas
    for kind in want:
        assert any(fid.startswith(f"fig-{kind}") for fid in figs), (kind, sorted(figs))
    return figs


def test_single_run_and_overlay_with_level_of_detail_zoom(browser, runs, shots, tmp_path):
    report = write_report([runs["single"], runs["jitter"]], tmp_path / "overlay.html",
                          Options(chrome=False, max_timelines=1))
    zoom = """(() => { const gd = document.querySelector('[id^="fig-timeline"]');
      const r = gd._fullLayout.xaxis.range, before = +gd.dataset.lodDraws;
      const w = [r[0] + 0.4 * (r[1] - r[0]), r[0] + 0.45 * (r[1] - r[0])];
      Plotly.relayout(gd, {'xaxis.range': w});
      return new Promise(ok => (function wait() {
        if (+gd.dataset.lodDraws > before) ok({range: gd._fullLayout.xaxis.range,
          visible: +gd.dataset.lodVisible, exact: gd.dataset.lodExact,
          points: gd._fullData.reduce((n, t) => n + t._length, 0)});
        else setTimeout(wait, 10); })()); })()"""
    page = browser.open(report, screenshot=shots / "overlay.png", evaluate={"zoom": zoom})
    check_rendered(page, ["summary", "timeline", "memory", "overlay"])
    z = page.values["zoom"]
    spans = timed(rd.load(runs["single"]).trace.spans)
    x0, x1 = z["range"]
    want = sum(1 for s in spans + idle_gaps(spans) if s.end_us >= x0 and s.start_us < x1)
    # each span in the window drawn as its own segment (start, middle, end, gap), with hover
    assert z["exact"] == "1" and z["visible"] == want > 0 and z["points"] == 4 * want
    assert (shots / "overlay.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_report(browser, runs, shots, tmp_path):
    report = write_report([runs["sweep"]], tmp_path / "sweep.html", Options(chrome=False))
    page = browser.open(report, screenshot=shots / "sweep.png")
    figs = check_rendered(page, ["summary", "timeline", "memory", "sweep"])
    assert sum(fid.startswith("fig-sweep") for fid in figs) == 4  # throughput, efficiency, memory, per GPU


def test_pipeline_and_oom_report(browser, runs, shots, tmp_path):
    report = write_report([runs["pp"], runs["oom"]], tmp_path / "pp_oom.html", Options(chrome=False))
    page = browser.open(report, screenshot=shots / "pp_oom.png")
    check_rendered(page, ["summary", "timeline", "memory", "sweep"])
    assert "OUT OF MEMORY" in report.read_text()


def test_calibration_report(browser, bench_dir, shots, tmp_path):
    # the CLI hands the report its model of a bench directory: drawn beside the points
    report = write_report([bench_dir], tmp_path / "calibration.html", Options(model=bench_model(None)))
    page = browser.open(report, screenshot=shots / "calibration.png")
    figs = check_rendered(page, ["calibration"])
    assert len(figs) == 2


def test_a_javascript_error_is_caught(browser, bench_dir, tmp_path):
    """The check above can fail: a page that throws is reported."""
    good = write_report([bench_dir], tmp_path / "good.html")
    bad = tmp_path / "bad.html"
    bad.write_text(good.read_text().replace("</body>", "<script>undefinedFunction()</script></body>"))
    page = browser.open(bad)
    assert any("undefinedFunction" in e for e in page.errors)
