"""`paratwin report DIR [DIR ...]`: the HTML report (and Chrome exports) of run directories."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from paratwin.config import preset_cluster
from twin.spec import ConfigError

if TYPE_CHECKING:
    from twin.report.calibration import Model

OVERRIDE_PREFIXES = ("-", "+", "~")


def positional_runs(args: list[str]) -> list[str]:
    """Leading arguments that are directories (or have no '=') become one ``runs=[...]``
    override; Hydra takes no positional arguments. A Hydra sweep directory such as
    ``0-cluster.num_nodes=2`` counts as a directory because it exists."""
    dirs: list[str] = []
    for a in args:
        if a.startswith(OVERRIDE_PREFIXES) or ("=" in a and not Path(a).exists()):
            break
        dirs.append(a)
    if not dirs:
        return args
    quoted = ",".join("'" + d.replace("\\", "\\\\").replace("'", "\\'") + "'" for d in dirs)
    return [f"runs=[{quoted}]", *args[len(dirs):]]


def bench_model(cluster_name: str | None) -> Model:
    """The report's model of a bench directory: its modelled.csv, else the rows the twin
    predicts for each benchmarked point on the cluster the benchmarks ran on (``cluster_name``,
    the directory's config, or cpu_local for a gloo bench), under its profile YAML if any."""
    from twin.calibrate.predict import model_bench_dir
    from twin.calibrate.profile import read_csv
    from twin.report.rundir import csv_kind

    def model(run) -> tuple[list[dict], str]:
        rows = {"collective": [], "kernel": []}
        for p in run.bench_csvs:
            rows[csv_kind(p)] += read_csv(p)
        return model_bench_dir(run.path, rows["collective"], rows["kernel"], run.cluster,
                               run.profile_path, cluster_name, preset_cluster)
    return model


def run(cfg) -> dict:
    """Write the report; print where it and the Chrome exports went."""
    from twin.metrics import summarize
    from twin.report.browser import BrowserError
    from twin.report.build import Options, build

    runs = [str(r) for r in (cfg.get("runs") or [])]
    if cfg.get("run"):
        runs.insert(0, str(cfg.run))
    if not runs:
        raise ConfigError("no run directory given; use `paratwin report DIR [DIR ...]` or "
                          "runs=[DIR,...] (directories written by simulate, execute or bench)")
    for key, least in (("max_spans", 1), ("max_timelines", 0)):
        if int(cfg.get(key)) < least:
            raise ConfigError(f"{key}={cfg.get(key)} must be at least {least}")
    opts = Options(max_spans=int(cfg.max_spans), max_timelines=int(cfg.max_timelines),
                   chrome=bool(cfg.chrome), title=cfg.get("title"), png=bool(cfg.get("png")),
                   model=bench_model(cfg.get("cluster")), summarize=summarize,
                   force=bool(cfg.get("force", False)))
    try:
        done = build(runs, cfg.get("out"), opts)
    except (FileNotFoundError, NotADirectoryError, ValueError, RuntimeError) as err:
        raise ConfigError(str(err)) from None
    path = done.report
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB; opens offline)")
    for p in done.chrome:
        print(f"wrote {p} (Chrome trace: open it in ui.perfetto.dev or chrome://tracing)")
    if done.png:
        print(f"wrote {len(done.png)} PNG files in {done.png[0].parent}")
    out = {"report": str(path), "chrome": [str(p) for p in done.chrome],
           "png": [str(p) for p in done.png]}
    if cfg.get("check"):
        from twin.report.browser import check_page

        try:
            page = check_page(path)
        except BrowserError as err:
            raise ConfigError(f"check=true: {err}") from None
        if page.errors:
            raise ConfigError(f"check=true: the report logs JavaScript errors: {page.errors[:3]}")
        figs = page.probe.get("figures", {})
        print(f"checked in headless chromium: {len(figs)} figures drawn, no JavaScript error, "
              f"loaded in {page.load_ms / 1000:.1f} s")
        out["check"] = {"figures": len(figs), "load_ms": page.load_ms}
    return out
