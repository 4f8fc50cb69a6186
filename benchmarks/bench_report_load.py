"""How long a 200,000-span report takes to write and to load in headless Chromium, and how
quickly it answers a zoom. Prints the figures (no pass/fail): run it after changing twin/report.

    python benchmarks/bench_report_load.py [--spans 200000] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from twin.report import write_report  # noqa: E402
from twin.report.browser import Browser  # noqa: E402
from twin.sim.run import simulate  # noqa: E402
from twin.spec import ClusterSpec, GPUSpec, ModelSpec, ParallelPlan, build_job  # noqa: E402

ZOOM = """(() => { const gd = document.querySelector('[id^="fig-timeline"]');
  const r = gd._fullLayout.xaxis.range, before = +gd.dataset.lodDraws, t0 = performance.now();
  Plotly.relayout(gd, {'xaxis.range': [r[0], r[0] + (r[1] - r[0]) / 20]});
  return new Promise(ok => (function wait() {
    if (+gd.dataset.lodDraws > before) requestAnimationFrame(() => ok(performance.now() - t0));
    else setTimeout(wait, 5); })()); })()"""


def make_run(directory: Path, spans: int) -> int:
    """A 3D-parallel (dp2 tp2 pp2, 1F1B) GPT on 8 GPUs, simulated for enough steps."""
    model = ModelSpec(name="gpt", num_layers=8, hidden_size=256, num_heads=8, num_kv_heads=8,
                      ffn_hidden_size=1024, vocab_size=1000, seq_len=128, activation="gelu")
    cluster = ClusterSpec(name="bench", num_nodes=1, gpus_per_node=8,
                          gpu=GPUSpec(name="g", peak_tflops={"bf16": 100.0, "fp32": 10.0}))
    job = build_job(model, cluster, ParallelPlan(tp=2, pp=2, sp=True, zero_stage=1))
    per_step = len(simulate(job).trace.spans)
    result = simulate(job, steps=max(1, -(-spans // per_step)))
    directory.mkdir(parents=True, exist_ok=True)
    result.trace.save(directory / "spans.json")
    (directory / "summary.json").write_text(json.dumps(result.summary.to_dict(), default=float))
    return len(result.trace.spans)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spans", type=int, default=200_000)
    ap.add_argument("--keep", type=Path, default=None, help="write the run directory here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = args.keep or Path(tmp) / "run"
        n = make_run(run, args.spans)
        t0 = time.perf_counter()
        report = write_report([run])
        write_s = time.perf_counter() - t0
        with Browser(timeout_s=300) as browser:
            page = browser.open(report, timeout_s=300, evaluate={"zoom_ms": ZOOM})
        figs = page.probe["figures"]
        print(f"spans in trace:          {n:,}")
        print(f"report size:             {report.stat().st_size / 1e6:.1f} MB "
              f"(+ trace.json {(run / 'trace.json').stat().st_size / 1e6:.1f} MB)")
        print(f"write_report:            {write_s:.1f} s")
        print(f"load in headless chrome: {page.load_ms / 1000:.1f} s to every figure drawn "
              f"({page.wall_s:.1f} s wall incl. tab setup), {len(figs)} figures, "
              f"{sum(f['points'] for f in figs.values()):,} points")
        print(f"JavaScript errors:       {len(page.errors)} {page.errors[:2]}")
        print(f"browser:                 {browser.version}")
        print(f"zoom to 1/20 of the axis: {page.values['zoom_ms']:.0f} ms to redraw at the new "
              "level of detail")


if __name__ == "__main__":
    main()
