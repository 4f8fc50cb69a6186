"""Hold a twin prediction against a measured run of the same schedule (pure; no torch).

Step time: the measured median and p10-p90 band over steps against the twin's prediction.
Per op kind: for the ops both traces hold (joined by rank and op id), the twin's summed
duration against the measured one in the measured run's median step. A PyTorch training
run (conformance) has no op ids: its per-kind figures are torch.profiler's CPU seconds of
one step summed over ranks, against the twin's summed spans of the same kind
(``profile_kind_errors``). Rows of several sources (replay, pytorch) keep each source's
figures under ``row["sources"][source]``; ``suite_figures(rows, source)`` reads them. On a
noisy host a run whose band is wide (another tenant took the cores for part of it) can be
measured again (``steadiest``).
"""

from __future__ import annotations

import hashlib
import json
import statistics
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from twin.trace import Trace
from twin.vocab import COLLECTIVE_KINDS, COMPUTE_KINDS, MEMORY_KINDS, P2P_KINDS

MEMORY = MEMORY_KINDS


def kind_key(kind: str, group: str) -> str:
    return f"{kind} ({group})" if group and kind not in ("send", "recv") else kind


def median_step(trace: Trace) -> int:
    """The measured step whose duration is the median."""
    span: dict[int, list[float]] = defaultdict(lambda: [float("inf"), float("-inf")])
    for s in trace.spans:
        if s.kind in MEMORY:
            continue
        w = span[s.step]
        w[0] = min(w[0], s.start_us)
        w[1] = max(w[1], s.end_us)
    times = {k: v[1] - v[0] for k, v in span.items()}
    med = statistics.median(times.values())
    return min(times, key=lambda k: abs(times[k] - med))


def kind_errors(measured: Trace, predicted: Trace, step: int | None = None) -> dict[str, dict]:
    """Per op kind: measured and predicted seconds summed over the ops both traces hold."""
    step = median_step(measured) if step is None else step
    pred = {(s.rank, s.op): s for s in predicted.spans if s.step == 0 and s.kind not in MEMORY}
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    matched = unmatched = 0
    for s in measured.spans:
        if s.step != step or s.kind in MEMORY:
            continue
        p = pred.get((s.rank, s.op))
        if p is None:
            unmatched += 1
            continue
        matched += 1
        row = sums[kind_key(s.kind, s.group)]
        row[0] += s.dur_us / 1e6
        row[1] += p.dur_us / 1e6
        row[2] += 1
    out = {k: {"measured_s": m, "predicted_s": p, "ops": n,
               "error": (p / m - 1) if m > 0 else None} for k, (m, p, n) in sorted(sums.items())}
    out["_join"] = {"matched": matched, "unmatched": unmatched}
    return out


def compare(measured_summary: dict, predicted_summary: dict) -> dict:
    """Step-time error and whether the prediction falls in the measured p10-p90 band."""
    m = measured_summary
    p = predicted_summary["step_time_s"]
    return {"measured_p50_s": m["step_time_s"], "measured_p10_s": m["step_time_p10_s"],
            "measured_p90_s": m["step_time_p90_s"], "predicted_s": p,
            "error": p / m["step_time_s"] - 1,
            "in_band": m["step_time_p10_s"] <= p <= m["step_time_p90_s"]}


def profile_id(cost) -> str:
    """A profile's identity: a digest of everything it holds (fitted profiles keep their
    cluster's name, so the name alone does not tell two fits apart)."""
    text = json.dumps(cost.to_dict(), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def kept_summary(src: dict) -> dict:
    """A source's kept measurement (resume) as ``compare`` reads a summary."""
    return {"step_time_s": src["measured_p50_s"], "step_time_p10_s": src["measured_p10_s"],
            "step_time_p90_s": src["measured_p90_s"]}


def spread(measured_summary: dict) -> float:
    """The measured p10-p90 band's width over the median (0.06-0.15 on a quiet host)."""
    m = measured_summary
    return (m["step_time_p90_s"] - m["step_time_p10_s"]) / m["step_time_s"]


def steadiest(measure: Callable[[Path], dict], first: Path, max_spread: float | None,
              retries: int, log: Callable[[str], None] = lambda _m: None) \
        -> tuple[Path, dict, list[dict]]:
    """Measure into ``first``; while the measurement's spread exceeds ``max_spread`` (None:
    never) measure again, up to ``retries`` times, each into a directory of its own beside
    ``first`` (NAME.retryK); keep the narrowest. ``measure(dir)`` returns the run's summary
    (step_time_s and its p10 and p90). Returns (its directory, its summary, every attempt's
    directory, median and spread)."""
    best: tuple[float, Path, dict] | None = None
    attempts: list[dict] = []
    for k in range(1 + (max(0, retries) if max_spread is not None else 0)):
        where = first if k == 0 else first.with_name(f"{first.name}.retry{k}")
        summary = measure(where)
        width = spread(summary)
        attempts.append({"dir": where.name, "measured_p50_s": summary["step_time_s"],
                         "spread": width})
        if best is None or width < best[0]:
            best = (width, where, summary)
        if max_spread is None or width <= max_spread:
            break
        if k < retries:
            log(f"p10-p90 spread {width:.0%} of the median is over max_spread={max_spread:g}: "
                f"measuring again ({k + 1}/{retries})")
    return best[1], best[2], attempts


PROFILE_NOTE = ("torch.profiler CPU self time of one step, summed over ranks: compute kinds "
                "compare with the twin's time of their ops (the cost model's, as a fit holds "
                "them; without contention or call costs); collectives is the time spent "
                "issuing them (gloo runs them on its own threads), unattributed the step's wall "
                "time no event covers (mostly waiting for them), framework the autograd engine, "
                "hooks and Python: no twin counterpart")


def profile_kind_errors(measured: dict[str, float], predicted: Trace,
                        compute: dict[str, float] | None = None) -> dict[str, dict]:
    """Per kind: profiled CPU seconds (``measured``: gemm, attention, elementwise, optimizer,
    collectives, framework, unattributed) against the twin's summed spans of step 0 over all
    ranks, or for the compute kinds ``compute`` (kind -> seconds over all ranks: the cost
    model's time of the kind's ops, as a fit predicts a kind target, without a shared core's
    contention or the call costs a CPU thread adds to its next op); an error only for the
    compute kinds (the others time something else)."""
    pred: dict[str, float] = defaultdict(float)
    for s in predicted.spans:
        if s.step != 0 or s.kind in MEMORY:
            continue
        kind = "collectives" if s.kind in COLLECTIVE_KINDS + P2P_KINDS else s.kind
        pred[kind] += s.dur_us / 1e6
    if compute is not None:  # the compute kinds from it alone
        pred.update({k: compute.get(k, 0.0) for k in COMPUTE_KINDS})
    out: dict[str, dict] = {}
    for k, m in measured.items():
        p = pred.get(k, 0.0) if k in COMPUTE_KINDS or k == "collectives" else None
        out[k] = {"measured_s": m, "predicted_s": p, "ops": None,
                  "error": (p / m - 1) if k in COMPUTE_KINDS and m > 0 else None}
    out["_source"] = {"source": "torch.profiler", "note": PROFILE_NOTE}
    return out


def source_rows(rows: list[dict], source: str) -> list[dict]:
    """The rows' figures for one source (name, parallel and world size added); rows without
    ``sources`` (written before there were several) are replay rows; skipped ones left out."""
    out = []
    for r in rows:
        fig = (r.get("sources") or {"replay": r}).get(source)
        if fig is not None and "skipped" not in fig:
            out.append({**fig, "name": r["name"], "parallel": r.get("parallel"),
                        "world_size": r["world_size"]})
    return out


def suite_figures(rows: list[dict], source: str | None = None) -> dict:
    """Median absolute error, the largest error, and predictions inside their bands (of the
    rows' top-level figures, or of ``source``'s)."""
    if source is not None:
        rows = source_rows(rows, source)
    errs = [abs(r["error"]) for r in rows]
    worst = max(rows, key=lambda r: abs(r["error"])) if rows else None
    return {"runs": len(rows),
            "median_abs_error": statistics.median(errs) if errs else None,
            "max_abs_error": max(errs) if errs else None,
            "worst": worst["name"] if worst else None,
            "in_band": sum(r["in_band"] for r in rows)}
