"""Regenerate the gallery's screenshots: real twin runs, reports, headless Chromium.

    python reports/gallery/make_gallery.py [--bench DIR]   (DIR: from `paratwin bench`)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from twin.cost import default_cost_model  # noqa: E402
from twin.report import Options, write_report  # noqa: E402
from twin.report.browser import Browser  # noqa: E402
from twin.sim.engine import SimOptions  # noqa: E402
from twin.sim.run import simulate  # noqa: E402
from twin.spec import ClusterSpec, GPUSpec, ModelSpec, ParallelPlan, build_job  # noqa: E402
from twin.spec.io import job_to_dict  # noqa: E402

HERE = Path(__file__).resolve().parent
GPT = ModelSpec(name="gpt", num_layers=8, hidden_size=256, num_heads=8, num_kv_heads=8,
                ffn_hidden_size=1024, vocab_size=1000, seq_len=128, activation="gelu")
GPT2 = ModelSpec(name="gpt2_small", num_layers=12, hidden_size=768, num_heads=12, num_kv_heads=12,
                 ffn_hidden_size=3072, vocab_size=50257, seq_len=1024, activation="gelu")


def node(nodes: int = 1, gpus: int = 8, hbm_GB: float = 80.0) -> ClusterSpec:
    return ClusterSpec(name="dgx_h100", num_nodes=nodes, gpus_per_node=gpus, gpu=GPUSpec(
        name="H100", peak_tflops={"bf16": 989.0, "fp32": 67.0}, hbm_GB=hbm_GB, hbm_bw_GBps=3350.0))


def run(directory: Path, job, steps: int = 1, **kw) -> Path:
    res = simulate(job, steps=steps, **kw)
    directory.mkdir(parents=True, exist_ok=True)
    res.trace.save(directory / "spans.json")
    (directory / "summary.json").write_text(json.dumps(res.summary.to_dict(), default=float))
    (directory / "config.yaml").write_text(json.dumps(job_to_dict(job)))
    return directory


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", type=Path, default=None)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="paratwin-gallery-"))
    job3d = build_job(GPT, node(), ParallelPlan(tp=2, pp=2, sp=True, zero_stage=1))
    single = run(tmp / "3d", job3d)
    noisy = dataclasses.replace(default_cost_model(job3d.cluster), compute_cv=0.08, comm_cv=0.25)
    jitter = run(tmp / "3d-jitter", job3d, cost=noisy, options=SimOptions(jitter=True, seed=1))
    big = run(tmp / "3d-200k", job3d, steps=21)
    oom = run(tmp / "oom", build_job(GPT2, node(1, 8, hbm_GB=2.0), ParallelPlan(
        global_batch_size=64)))
    sweep = [run(tmp / "ddp" / f"{i}-nodes{n}", build_job(GPT2, node(n), ParallelPlan(
        global_batch_size=128))) for i, n in enumerate((1, 2, 4, 8))]
    shots = {}
    with Browser(timeout_s=300) as b:
        r = write_report([single], tmp / "single.html", Options(chrome=False))
        b.open(r, elements={"[id^=fig-timeline]": HERE / "timeline.png",
                            "#summary ~ table": HERE / "summary.png"})
        r = write_report([big], tmp / "big.html", Options(chrome=False))
        zoom = """(() => { const gd = document.querySelector('[id^="fig-timeline"]');
          const r = gd._fullLayout.xaxis.range, d = +gd.dataset.lodDraws;
          Plotly.relayout(gd, {'xaxis.range': [r[0] + 0.5 * (r[1] - r[0]), r[0] + 0.53 * (r[1] - r[0])]});
          return new Promise(ok => (function w() { +gd.dataset.lodDraws > d ? setTimeout(ok, 300)
            : setTimeout(w, 20); })()); })()"""
        b.open(r, elements={"[id^=fig-timeline]": HERE / "timeline-200k-full.png"})
        b.open(r, evaluate={"zoom": zoom}, elements={"[id^=fig-timeline]": HERE / "timeline-200k-zoom.png"})
        r = write_report([oom], tmp / "oom.html", Options(chrome=False))
        b.open(r, elements={"[id^=fig-memory]": HERE / "memory-oom.png"})
        r = write_report([single, jitter], tmp / "overlay.html", Options(chrome=False, max_timelines=0))
        b.open(r, elements={"#fig-overlay-0-1": HERE / "overlay-lanes.png",
                            "#fig-overlay-0-2": HERE / "overlay-residuals.png"})
        r = write_report(sweep, tmp / "sweep.html", Options(chrome=False, max_timelines=0))
        b.open(r, elements={"#fig-sweep-1": HERE / "sweep-throughput.png",
                            "#fig-sweep-2": HERE / "sweep-efficiency.png"})
        if args.bench:
            r = write_report([args.bench], tmp / "calibration.html", Options(chrome=False))
            b.open(r, elements={"#fig-calibration-0-1": HERE / "calibration-collectives.png"})
    print("\n".join(sorted(str(p) for p in HERE.glob("*.png"))), shots or "")


if __name__ == "__main__":
    main()
