"""`paratwin calibrate`: measure this machine and fit the twin's cost model into a profile."""

from __future__ import annotations

import csv
import io
import json
import re
import shutil
from pathlib import Path

from omegaconf import OmegaConf

from paratwin.config import CONF_DIR, to_spec
from paratwin.outdir import out_dir
from twin import rundir
from twin.calibrate.predict import MODELLED_COLUMNS, modelled_rows
from twin.calibrate.profile import build_profile, read_csv
from twin.cost import PROFILE_FORMAT, CostModel
from twin.files import write_text_atomic
from twin.spec import ClusterSpec, ConfigError

PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
"""A profile name: a plain file stem, so conf/profiles/NAME.yaml stays in conf/profiles/."""


def profile_name(cfg, cluster: ClusterSpec) -> str:
    """The profile's name (name=, else the cluster's), refused unless a plain file stem."""
    name = str(cfg.get("name") or cluster.name)
    field = "name" if cfg.get("name") else "cluster.name"
    if not PLAIN_NAME.fullmatch(name) or name.endswith(".yaml"):
        raise ConfigError(f"{field}={name!r} is not a plain profile name (letters, digits, "
                          "'.', '_', '-'; no folders or .yaml): calibrate writes "
                          "conf/profiles/NAME.yaml; to write the profile elsewhere give "
                          "out=PATH")
    return name


def profile_path(cfg, cluster: ClusterSpec) -> Path:
    if cfg.get("out"):
        path = Path(str(cfg.out))
        if path.is_dir():
            raise ConfigError(f"out={path} is a directory; give the profile's file path, e.g. "
                              f"out={path / (profile_name(cfg, cluster) + '.yaml')}")
        return path
    return CONF_DIR / "profiles" / f"{profile_name(cfg, cluster)}.yaml"


def check_writable(path: Path) -> None:
    """An existing file there must be a paratwin profile; anything else is left untouched."""
    if path.exists():
        try:
            CostModel.load(path)
        except ValueError as err:
            if _is_profile(path):
                return  # a profile with bad values: the new fit replaces it
            raise ConfigError(f"{path} exists and is not a paratwin profile ({err}); it was not "
                              "overwritten: move it away or choose another out=PATH") from None


def _is_profile(path: Path) -> bool:
    """Whether ``path`` holds YAML marked as a paratwin profile (whatever its values)."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return False
    return isinstance(data, dict) and data.get("format") == PROFILE_FORMAT


def run_bench(run_dir: Path, overrides: list[str], timeout_s: float) -> Path:
    """`paratwin bench` into RUN_DIR/bench (its config composed here, its run called in this
    process), its progress shown as it runs."""
    from hydra import compose

    from paratwin.verbs import bench

    out = run_dir / "bench"
    args = [f"out_dir={out}", f"timeout_s={timeout_s}", *overrides]
    print(f"measuring: bench {' '.join(args)}", flush=True)
    try:
        bench.run(compose(config_name="bench", overrides=args))
    except SystemExit as err:
        raise ConfigError(f"paratwin bench failed (exit {err.code}); see its output above") from None
    return out


def run_interference(run_dir: Path, world: int, gemm_n: int, timeout_s: float) -> dict:
    from executor.launch import launch_local
    from twin import rundir

    out = run_dir / "interference"
    rundir.prepare(out, "interference")
    rundir.write_json(out / rundir.SETTINGS, {
        "task": "interference", "world_size": world, "backend": "gloo", "threads": 1,
        "timeout_s": timeout_s, "comm_timeout_s": timeout_s, "gemm_n": gemm_n, "repeats": 10,
        "cycles": 5, "comm_bytes": 64 * 2**20, "comm_ops": 8})
    print(f"measuring interference: {world} ranks, {gemm_n}^3 GEMMs alone, together, beside "
          "all-reduces", flush=True)
    launch_local(out, world, timeout_s=timeout_s, log=lambda m: None)
    return json.loads((out / "interference.json").read_text())


def write_modelled(run_dir: Path, bench_dir: Path, cluster: ClusterSpec, profile: CostModel) -> Path:
    """modelled.csv: every benchmarked point measured beside the fitted profile's prediction."""
    rows = {name: read_csv(bench_dir / name) if (bench_dir / name).exists() else []
            for name in (rundir.COLLECTIVES_CSV, rundir.KERNELS_CSV)}
    table = modelled_rows(rows[rundir.COLLECTIVES_CSV], rows[rundir.KERNELS_CSV], cluster, profile)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=MODELLED_COLUMNS)
    writer.writeheader()
    writer.writerows(table)
    return write_text_atomic(run_dir / rundir.MODELLED, buf.getvalue())


def format_fits(profile: CostModel, report: dict, path: Path) -> str:
    host = any("host_us" in v["params"] for v in report["kernels"].values())  # a GPU sweep's
    lines = [f"profile {profile.name} -> {path}", "", "kernels (t = max(F/(P*E), B/(W*M)) + L):",
             f"  {'kind/dtype':<20} {'E':>6} {'M':>6} {'L us':>8} {'resid med':>10} {'max':>7} {'pts':>4}"
             + (f" {'host us':>8}" if host else "")]
    for k, v in report["kernels"].items():
        p = v["params"]
        lines.append(f"  {k:<20} {p['efficiency']:>6.3f} {p['mem_efficiency']:>6.3f} "
                     f"{p['launch_us']:>8.1f} {v['residual_median']:>10.1%} {v['residual_max']:>7.1%} "
                     f"{v['points']:>4}" + (f" {p['host_us']:>8.1f}" if "host_us" in p else "")
                     + (f"  unaligned n/k x{p['unaligned_efficiency']:.3f}"
                        if "unaligned_efficiency" in p else ""))
    lines += ["", "collectives (t = latency + S / bw):",
              f"  {'kind/link/n':<26} {'latency us':>11} {'bw GB/s':>9} {'resid med':>10} {'max':>7}"]
    for k, v in report["collectives"].items():
        lines.append(f"  {k:<26} {v['latency_us']:>11.1f} {v['bw_GBps']:>9.3f} "
                     f"{v['residual_median']:>10.1%} {v['residual_max']:>7.1%}")
    if "interference" in report:
        i = report["interference"]
        lines += ["", f"interference: {i['world_size']} ranks computing together take "
                      f"{i['gemm_concurrent_s'] / i['gemm_alone_s']:.2f}x alone -> "
                      f"{i['cores_effective']:.2f} effective cores; beside all-reduces "
                      f"{1 + i['overlap_measured']:.2f}x measured, {1 + i['overlap_modelled']:.2f}x "
                      f"modelled (overlap_slowdown {i['overlap_slowdown']:.2f})"]
    lines.append(f"noise: compute_cv {profile.compute_cv:.3f}, comm_cv {profile.comm_cv:.3f}")
    return "\n".join(lines)


def run(cfg) -> dict:
    fmt = cfg.get("format", "text")
    if fmt not in ("text", "json"):
        raise ConfigError(f"format={fmt!r} is not one of text|json")
    if cfg.get("traces"):  # the executor's own runs: every op in the step where it ran
        from paratwin.fittraces import fit_from_traces
        from paratwin.fittraces import format_report as format_traces

        def where(cluster: ClusterSpec) -> tuple[Path, str]:
            path = profile_path(cfg, cluster)
            check_writable(path)
            return path, str(cfg.get("name") or cluster.name)

        report = fit_from_traces(cfg, where, lambda: rundir.claim(
            out_dir(cfg, "calibrate"), "calibrate", bool(cfg.get("force", False))))
        Path(report["run_dir"], "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        print(json.dumps(report, indent=2, default=float) if fmt == "json" else format_traces(report))
        return report
    if cfg.get("runs"):  # measured step times of whole runs, not microbenchmarks
        from paratwin.fitruns import fit_from_runs, format_report

        def path_for(cluster: ClusterSpec) -> tuple[Path, str]:
            path = profile_path(cfg, cluster)
            check_writable(path)
            return path, str(cfg.get("name") or cluster.name)

        def claim() -> Path:
            return rundir.claim(out_dir(cfg, "calibrate"), "calibrate", bool(cfg.get("force", False)))

        report = fit_from_runs(cfg, path_for, claim)
        Path(report["run_dir"], "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        print(json.dumps(report, indent=2, default=float) if fmt == "json" else format_report(report))
        return report
    cluster = to_spec(ClusterSpec, cfg.get("cluster"), "cluster")
    path = profile_path(cfg, cluster)
    check_writable(path)
    run_dir = rundir.claim(out_dir(cfg, "calibrate"), "calibrate", bool(cfg.get("force", False)))
    timeout_s = float(cfg.get("timeout_s", 600))
    if cfg.get("bench_dir"):
        bench_dir = Path(str(cfg.bench_dir))
        if not bench_dir.is_dir():
            raise ConfigError(f"bench_dir={bench_dir} is not a directory; run `paratwin bench` "
                              "or leave bench_dir unset to measure now")
    else:
        bench_dir = run_bench(run_dir, list(cfg.get("bench") or []), timeout_s)
    interference = None
    if cfg.get("interference", True) and cluster.intra.kind == "shared_cpu":
        interference = run_interference(run_dir, max(2, cluster.gpus_per_node),
                                        int(cfg.get("interference_gemm_n", 512)), timeout_s)
    dtype = "fp32" if "fp32" in cluster.gpu.peak_tflops and cluster.intra.kind == "shared_cpu" \
        else "bf16"
    name = str(cfg.get("name") or cluster.name) if cfg.get("out") else profile_name(cfg, cluster)
    try:
        profile, report = build_profile(bench_dir, cluster, name, dtype, interference)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    path.parent.mkdir(parents=True, exist_ok=True)
    profile.save(path)  # atomic: a temporary file renamed into place
    if bench_dir != run_dir / "bench":
        for f in (rundir.COLLECTIVES_CSV, rundir.KERNELS_CSV, rundir.BENCH_META):
            if (bench_dir / f).exists():
                shutil.copy(bench_dir / f, run_dir / f)
    profile.save(run_dir / rundir.PROFILE)
    rundir.write_json(run_dir / rundir.FITS, report)
    write_modelled(run_dir, bench_dir, cluster, profile)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    print(json.dumps({"profile": str(path), **report}, indent=2, default=float) if fmt == "json"
          else format_fits(profile, report, path))
    return {"profile": str(path), **report}
