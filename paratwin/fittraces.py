"""`paratwin calibrate traces=RUN_DIRS`: the cost model fitted to the executor's own runs.

Every directory is read (``twin.calibrate.traces.load_run``) before anything is written; a
directory that is not a finished `paratwin execute` run stops the verb in one line. The
fit starts from the cluster's own profile (``calibration=auto``), replaces what the traces
measure (kernels per kind, collectives, host gaps) and keeps the rest. Each traced run is
then simulated under the new profile beside its measured step (in-sample: hold the profile
to other runs with `paratwin validate calibration=PROFILE`).
"""

from __future__ import annotations

import sys
from pathlib import Path

from paratwin.config import load_profile
from paratwin.fitruns import expand_paths
from twin import rundir
from twin.calibrate.traces import TraceError, fit_traces, load_run
from twin.sim.run import simulate
from twin.spec import ConfigError


def trace_dirs(spec) -> list[Path]:
    """Directories named by ``traces=`` (a list, a comma-separated string, glob patterns)."""
    out = expand_paths(spec, "traces", "run directory")
    if not out:
        raise ConfigError("traces= names no run directory; give the directories of "
                          "`paratwin execute` runs, e.g. traces=[runs/a,runs/b] or traces='runs/*'")
    return out


def fit_from_traces(cfg, path_for, claim) -> dict:
    """The traces workflow (module docstring); ``path_for(cluster)`` gives the profile's path
    and name, ``claim()`` the run directory, both once every directory has been read."""
    try:
        runs = [load_run(d) for d in trace_dirs(cfg.traces)]
    except TraceError as err:
        raise ConfigError(str(err)) from None
    cluster = runs[0].job.cluster
    profile_path, name = path_for(cluster)
    base = load_profile(cfg.get("start") or "auto", cluster)
    print(f"paratwin calibrate: fitting {len(runs)} executed runs (start: profile {base.name})",
          file=sys.stderr, flush=True)
    try:
        profile, report = fit_traces(runs, name, base, bool(cfg.get("start_kernels", False)))
    except TraceError as err:
        raise ConfigError(str(err)) from None
    run_dir = claim()
    rows = []
    for run in runs:
        predicted = simulate(run.job, profile).summary.step_time_s
        rows.append({"run": str(run.path), "measured_s": run.step_s,
                     "measured_p10_s": run.step_p10_s, "measured_p90_s": run.step_p90_s,
                     "predicted_s": predicted, "error": predicted / run.step_s - 1,
                     "in_band": run.step_p10_s <= predicted <= run.step_p90_s})
    profile_path.parent.mkdir(parents=True, exist_ok=True)
    profile.save(profile_path)  # atomic
    profile.save(run_dir / rundir.PROFILE)
    report = {"profile": str(profile_path), "run_dir": str(run_dir), "runs": rows, **report}
    rundir.write_json(run_dir / rundir.FITS, report)
    return report


def format_report(report: dict) -> str:
    lines = [f"profile -> {report['profile']}  (run directory {report['run_dir']})", "",
             "kernels from quiet ops (t = max(F/(P*E), B/(W*M)) + L; L includes the host gap):",
             f"  {'kind/dtype':<20} {'E':>6} {'M':>6} {'L us':>8} {'resid med':>10} {'pts':>4}"]
    for k, v in report["kernels"].items():
        p = v["params"]
        lines.append(f"  {k:<20} {p['efficiency']:>6.3f} {p['mem_efficiency']:>6.3f} "
                     f"{p['launch_us']:>8.1f} {v['residual_median']:>10.1%} {v['points']:>4}")
    gaps = report["host_gap_us"]
    into = next(iter(gaps.values()), {}).get("into", "-")
    lines.append(f"  host gap between ops (us, into {into}): "
                 + (", ".join(f"{k} {v['step_mean']:.0f}" for k, v in gaps.items()) or "none"))
    lines += ["", "collectives (t = latency + S / bw; latency includes skew and hand-off):",
              f"  {'kind/link/n':<26} {'latency us':>11} {'bw GB/s':>9} {'pts':>4}"]
    for k, v in report["collectives"].items():
        lines.append(f"  {k:<26} {v['latency_us']:>11.1f} {v['bw_GBps']:>9.3f} {v['points']:>4}")
    beside = report.get("busy_handoff_us") or {}
    if beside.get("us") is not None:
        lines.append(f"  beside busy cores a call waits {beside['us']:.0f} us more (busy_handoff_us, "
                     f"from {beside['sizes']} kinds and sizes measured both ways; taken off above)")
    if report["collectives_kept"]:
        lines.append(f"  kept from the start profile: {', '.join(report['collectives_kept'])}")
    if report.get("bandwidth_unidentified"):
        lines.append("  bandwidth not separable from latency (sizes too close or noisy; the start "
                     f"profile's kept): {', '.join(report['bandwidth_unidentified'])}")
    lines += ["", "the traced runs under the fitted profile (in-sample):",
              f"  {'run':<40} {'measured ms':>12} {'predicted ms':>13} {'error':>8} band"]
    for r in report["runs"]:
        lines.append(f"  {Path(r['run']).name[:40]:<40} {r['measured_s'] * 1e3:>12.1f} "
                     f"{r['predicted_s'] * 1e3:>13.1f} {r['error']:>+8.1%} "
                     f"{'yes' if r['in_band'] else 'no'}")
    return "\n".join(lines)
