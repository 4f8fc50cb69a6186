"""The report of some run directories: which sections their contents call for, and the file.

summary (any summary) -> timeline and memory (each run with a trace, up to max_timelines)
-> twin vs real (runs of the same schedule, joined by (rank, step, op)) -> sweep (runs of
different plans or GPU counts) -> calibration (directories with benchmark CSVs).
"""

from __future__ import annotations

import html as _html
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from twin.chrome import write_chrome
from twin.report import calibration, memory, moe, overlay, summary, sweep, timeline
from twin.report import rundir as rd
from twin.report import runs as runs_figure
from twin.report.html import Section, write
from twin.report.style import duration
from twin.rundir import REPORT, RunDirError, check_replace, chrome_path
from twin.trace import Trace


@dataclass
class Options:
    """What the report draws and writes (conf/report.yaml mirrors these)."""

    max_spans: int = timeline.MAX_SPANS
    """Spans drawn per timeline; beyond it only the first steps are drawn."""
    max_timelines: int = 4
    """Runs that get their own timeline and memory figures (0: none)."""
    chrome: bool = True
    """Write each traced run's Chrome/Perfetto export (trace.json) into its directory."""
    title: str | None = None
    model: calibration.Model | None = None
    """Calibration: a bench directory's measured-vs-modelled rows (the CLI's computes them on
    the cluster the benchmarks ran on); without it, the directory's modelled.csv if any."""
    summarize: rd.Summarizer | None = None
    """Runs with a trace but no summary.json: their summary (the CLI passes
    twin.metrics.summarize); without it they have none."""
    force: bool = False
    """Write the report over a file that is not a paratwin report."""
    png: bool = False
    """Also write one PNG per figure (kaleido + the system's chromium) into REPORT-png/."""


@dataclass
class Written:
    """What a report run wrote."""

    report: Path
    chrome: list[Path] = field(default_factory=list)
    png: list[Path] = field(default_factory=list)


def _name(run: rd.Run) -> str:
    return f"{run.name} ({run.source})"


def overlay_pairs(runs: list[rd.Run]) -> list[tuple[rd.Run, rd.Run]]:
    """(reference, other) for runs with traces of the same schedule; the reference is the
    first twin run of its group (else the first run)."""
    groups: dict[str, list[rd.Run]] = {}
    for r in runs:
        if r.trace is not None and r.job_key() is not None:
            groups.setdefault(r.job_key(), []).append(r)
    pairs = []
    for members in groups.values():
        if len(members) < 2:
            continue
        ref = next((m for m in members if m.source == "twin"), members[0])
        pairs += [(ref, m) for m in members if m is not ref]
    return pairs


def trace_sections(runs: list[rd.Run], opts: Options) -> list[Section]:
    out = []
    traced = [r for r in runs if r.trace is not None]
    for r in traced[:opts.max_timelines]:
        s = r.summary or {}
        head = f"{summary.run_label(r)}" + (f": step {duration(s['step_time_s'])}"
                                             if "step_time_s" in s else "")
        fig, note = timeline.timeline(r.trace, head, max_spans=opts.max_spans)
        lanes_note = ("One lane per rank and stream; grey is compute idle (pipeline bubbles, "
                      "waits for communication). Drag to zoom, double-click to reset, click a "
                      "legend entry to hide it. ")
        if isinstance(fig, tuple):
            lanes_note += ("Zoomed out, ops of a kind closer than a pixel merge into one bar; zoom "
                           "in until each op has its own (with its hover). ")
        out.append(Section(f"timeline-{len(out)}", f"timeline: {r.name}",
                           _html.escape(lanes_note + note), [fig]))
        over = s.get("peak_memory_overheads_bytes")  # what the alloc/free ops leave out
        static = {rank: over for rank in {sp.rank for sp in r.trace.spans}} if over else None
        mfig, mnote = memory.memory_figure(r.trace, r.hbm_bytes, f"memory over time: {r.name}",
                                           static=static)
        out.append(Section(f"memory-{len(out)}", f"memory: {r.name}", _html.escape(
            "Live bytes per category, stacked; dashed red: device memory. " + mnote),
            [mfig] if mfig else []))
    if len(traced) > opts.max_timelines and out:
        out[-1].note += _html.escape(f" ({len(traced) - opts.max_timelines} more traced runs have "
                                     "no timeline here: raise max_timelines to draw them)")
    return out


def overlay_sections(runs: list[rd.Run], opts: Options) -> list[Section]:
    out = []
    for ref, other in overlay_pairs(runs):
        names = (_name(ref), _name(other)) if ref.source == other.source else (ref.source, other.source)
        j = overlay.join(ref.trace, other.trace)
        res = overlay.residuals(j)
        fig, note = overlay.side_by_side(j, names, opts.max_spans)
        text = _html.escape(f"{ref.name} against {other.name}. {overlay.match_text(j, names)} {note}")
        figs = [fig]
        if res:
            figs += [overlay.residual_figure(res, names), overlay.scatter_figure(res, names)]
        out.append(Section(f"overlay-{len(out)}", f"{names[0]} vs {names[1]}", text, figs,
                           html=overlay.residual_table(res, names) if res else ""))
    return out


def sweep_sections(runs: list[rd.Run]) -> list[Section]:
    with_summary = [r for r in runs if r.summary]
    keys = {r.job_key() or r.name for r in with_summary}
    if len(with_summary) < 2 or len(keys) < 2:
        return []
    figs = sweep.scaling_figures(with_summary) if sweep.has_scaling(with_summary) else []
    figs += sweep.plan_figures(with_summary)
    note = ("Throughput and scaling efficiency against GPU count (dotted: linear), then memory and "
            "throughput per GPU for each run's plan.")
    return [Section("sweep", "sweep", _html.escape(note), figs)]


def calibration_sections(runs: list[rd.Run], model: calibration.Model | None = None) \
        -> list[Section]:
    out = []
    for r in runs:
        tables = [*r.bench_csvs, *([r.modelled_path] if r.modelled_path else [])]
        if tables:
            figs, note = calibration.calibration_figures(r, model)
            out.append(Section(f"calibration-{len(out)}", f"calibration: {r.name}", _html.escape(
                f"{len(tables)} benchmark table(s): {', '.join(p.name for p in tables)}; {note}"),
                figs))
    return out


def measured_runs_sections(runs: list[rd.Run]) -> list[Section]:
    out = []
    for r in runs:
        path = r.path / runs_figure.FILE
        if path.is_file():
            rows = runs_figure.read_rows(path)
            if rows:
                err = sorted(abs(x["error"]) for x in rows)
                note = (f"{len(rows)} measured runs in {path.name}: mean |error| "
                        f"{sum(err) / len(err):.1%}, largest {err[-1]:.1%}.")
                out.append(Section(f"runs-{len(out)}", f"measured runs: {r.name}",
                                   _html.escape(note), [runs_figure.scatter(rows)]))
    return out


def moe_sections(runs: list[rd.Run], opts: Options) -> list[Section]:
    """Mixture-of-experts runs: expert loads per layer and the exposed all-to-all per layer."""
    out = []
    for r in [r for r in runs if r.job is not None and r.job.model.moe is not None][
            :opts.max_timelines]:
        figs, note = moe.moe_figures(r.job, r.trace, r.name)
        out.append(Section(f"moe-{len(out)}", f"experts: {r.name}", _html.escape(note), figs))
    return out


def summary_sections(runs: list[rd.Run]) -> list[Section]:
    if not any(r.summary for r in runs):
        return []
    figs = [f for f in (summary.breakdown_figure(runs), summary.critical_path_figure(runs)) if f]
    derived = [r.name for r in runs if r.summary_derived]
    note = "The numbers to quote (median step)." + (
        f" No summary.json in {', '.join(derived)}: computed from the trace." if derived else "")
    return [Section("summary", "summary", _html.escape(note), figs,
                    html=summary.summary_table(runs))]


def sections(runs: list[rd.Run], opts: Options) -> list[Section]:
    """Every section the runs' contents call for, in reading order. A part that fails
    becomes a note in the report (and a warning), never a lost report."""
    parts = [("summary", lambda: summary_sections(runs)),
             ("timeline and memory", lambda: trace_sections(runs, opts)),
             ("experts", lambda: moe_sections(runs, opts)),
             ("twin vs real", lambda: overlay_sections(runs, opts)),
             ("sweep", lambda: sweep_sections(runs)),
             ("calibration", lambda: calibration_sections(runs, opts.model)),
             ("measured runs", lambda: measured_runs_sections(runs))]
    out: list[Section] = []
    for name, make in parts:
        try:
            out += make()
        except Exception as err:  # noqa: BLE001 - one broken part must not cost the others
            msg = f"the {name} part could not be drawn: {type(err).__name__}: {err}"
            print(f"paratwin report: warning: {msg}", file=sys.stderr)
            out.append(Section(f"failed-{len(out)}", f"{name} (failed)", _html.escape(msg)))
    return out


def output_path(paths: list[Path], out: str | Path | None, force: bool = False) -> Path:
    """report.html in the first run directory, in ``out`` if it is a directory, or ``out``;
    never a file that is not a paratwin report (unless ``force``)."""
    if out is None:
        target = paths[0] / REPORT
    else:
        out = Path(out)
        target = out / REPORT if out.is_dir() or not out.suffix else out
    return check_replace(target, "report", force)


def export_chrome(runs: list[rd.Run], report: Path) -> list[Path]:
    """Each traced run's Chrome export into its directory (beside the report if read-only),
    unless an export newer than the trace is already there."""
    written = []
    for r in runs:
        if r.trace is None:
            continue
        gpn = r.job.cluster.gpus_per_node if r.job is not None else None
        try:
            target = chrome_path(r.path)
        except RunDirError as err:
            print(f"paratwin report: warning: {err}", file=sys.stderr)
            continue
        if target.is_file() and r.trace_path is not None and \
                target.stat().st_mtime >= r.trace_path.stat().st_mtime:
            continue
        try:
            written.append(write_chrome(r.trace, target, gpn))
        except OSError:
            written.append(write_chrome(r.trace, report.parent / f"{r.name}.trace.json", gpn))
    return written


def build(run_dirs: list[str | Path], out: str | Path | None = None,
          options: Options | None = None, traces: Mapping[Path, Trace] | None = None) -> Written:
    """Write the report of ``run_dirs`` and, as the options say, Chrome exports and PNGs.
    ``traces``: run directory -> its trace as the caller holds it, just saved there
    (``Trace.as_saved``: not read back from the file)."""
    opts = options or Options()
    paths = rd.expand(list(run_dirs))
    held = {Path(p).resolve(): t for p, t in (traces or {}).items()}
    runs = [rd.load(p, opts.summarize, held.get(Path(p).resolve())) for p in paths]
    target = output_path(paths, out, opts.force)
    secs = sections(runs, opts)
    if len(runs) == 1:
        title = opts.title or f"paratwin report: {summary.run_label(runs[0])}"
    else:
        title = opts.title or f"paratwin report: {len(runs)} runs"
    sub = "<br>".join(_html.escape(summary.run_label(r)) + (
        f" &middot; {len(r.trace.spans):,} spans" if r.trace else "") for r in runs)
    done = Written(write(target, title, sub, secs))
    if opts.chrome:
        try:
            done.chrome = export_chrome(runs, target)
        except (OSError, ValueError) as err:
            print(f"paratwin report: warning: Chrome export not written ({err})", file=sys.stderr)
    if opts.png:
        from twin.report.png import export_png

        done.png = export_png(secs, target.parent / f"{target.stem}-png")
    return done


def write_report(run_dirs: list[str | Path], out: str | Path | None = None,
                 options: Options | None = None,
                 traces: Mapping[Path, Trace] | None = None) -> Path:
    """Write one self-contained HTML report of ``run_dirs`` (and each traced run's Chrome
    export, trace.json, into its directory); returns the report's path. ``traces``: see
    ``build``."""
    return build(run_dirs, out, options, traces).report
