"""Measured whole-run step times: the runs file, its column map, and its checks.

A runs file is a CSV with one measured run per row. Its columns are config keys in dotted
form (``model.hidden_size``, ``parallel.tp``, ``cluster.gpus_per_node``; ``model``,
``cluster``, ``parallel`` name presets) and the measurement, ``step_time_s`` or
``step_time_ms`` (the median optimizer step); a ``name`` column is kept as the row's label.
Optional ``gemm_s``, ``attention_s``, ``elementwise_s``, ``optimizer_s``: the seconds per step
one rank spends in that kind's ops (the mean over ranks, e.g. from torch.profiler), which
``paratwin calibrate`` fits beside the step times (twin.calibrate.kindtime); an empty cell
is a kind the row did not measure.
A foreign file (the A100 set's ``iteration time (ms)``) comes with a column map:

```yaml
columns: {"# GPUs": cluster.gpus_per_node, "iteration time (ms)": step_time_ms, ...}
set: {model.dtype: fp16, parallel.recompute: full}          # the same for every row
derive: {model.ffn_hidden_size: 4 * model.hidden_size}      # arithmetic on the row's keys
```

``read_runs`` checks every row before anything is fitted: a missing column, a value that is
not a number where one is needed, a step time that is not positive, each one line naming the
file, the row and the fix (``RunsFileError``). Building each row's job is the caller's (the
CLI composes presets); its problems are reported the same way, row by row.
"""

from __future__ import annotations

import ast
import csv
import math
import operator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

TIME_COLUMNS = {"step_time_s": 1.0, "step_time_ms": 1e-3}
KIND_COLUMNS = {f"{k}_s": k for k in ("gemm", "attention", "elementwise", "optimizer")}
"""Measured seconds per step and rank in one kind's ops -> the kind (twin.calibrate.kindtime)."""
PRESETS = ("model", "cluster", "parallel")
SECTIONS = ("model.", "cluster.", "parallel.")


class RunsFileError(ValueError):
    """A runs file (or its column map) that cannot be used: one line, the row and the fix."""


@dataclass(frozen=True)
class MeasuredRun:
    """One row: the config overrides that describe the run and its measured step time."""

    line: int
    """The row's line in the file (the header is line 1)."""
    overrides: dict[str, Any]
    """Dotted config keys -> values (presets under 'model', 'cluster', 'parallel')."""
    step_time_s: float
    name: str = ""
    kinds: dict[str, float] = field(default_factory=dict)
    """Kind -> measured seconds per step one rank spends in its ops (KIND_COLUMNS)."""

    @property
    def label(self) -> str:
        return self.name or f"line {self.line}"


@dataclass(frozen=True)
class ColumnMap:
    """How a foreign file's columns become config keys (see the module docstring)."""

    columns: dict[str, str] = field(default_factory=dict)
    set: dict[str, Any] = field(default_factory=dict)
    derive: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path) -> ColumnMap:
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as err:
            raise RunsFileError(f"column map {path}: cannot read it ({err})") from None
        if not isinstance(data, dict):
            raise RunsFileError(f"column map {path}: a mapping with columns/set/derive is expected")
        unknown = set(data) - {"columns", "set", "derive"}
        if unknown:
            raise RunsFileError(f"column map {path}: unknown sections {sorted(unknown)}; use "
                                "columns (file column -> config key), set, derive")
        out = cls({str(k).strip(): str(v) for k, v in (data.get("columns") or {}).items()},
                  dict(data.get("set") or {}), {str(k): str(v) for k, v in
                                                (data.get("derive") or {}).items()})
        for key in [*out.columns.values(), *out.set, *out.derive]:
            _check_key(key, f"column map {path}")
        return out


def _check_key(key: str, where: str) -> None:
    if key in TIME_COLUMNS or key in KIND_COLUMNS or key == "name" or key in PRESETS \
            or key.startswith(SECTIONS):
        return
    raise RunsFileError(f"{where}: {key!r} is not a config key; use model.FIELD, cluster.FIELD, "
                        f"parallel.FIELD, a preset (model, cluster, parallel), name, "
                        f"{' / '.join(TIME_COLUMNS)}, or a kind's time ({' / '.join(KIND_COLUMNS)})")


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
        ast.Pow: operator.pow}


def evaluate(expr: str, values: dict[str, Any]) -> Any:
    """``expr`` (numbers, dotted keys of ``values``, + - * / // % **, unary minus) on a row."""
    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, (ast.Name, ast.Attribute)):
            key = ast.unparse(node)
            if key not in values:
                raise KeyError(key)
            return values[key]
        raise ValueError(f"{ast.unparse(node)!r} is not arithmetic on the row's keys")

    return ev(ast.parse(expr, mode="eval"))


def _number(text: str) -> Any:
    """'8' -> 8, '1.5' -> 1.5, 'true' -> True, other text unchanged."""
    t = text.strip()
    if t.lower() in ("true", "false"):
        return t.lower() == "true"
    for cast in (int, float):
        try:
            return cast(t)
        except ValueError:
            pass
    return t


def read_runs(path: str | Path, columns: ColumnMap | None = None) -> list[MeasuredRun]:
    """Every row of a runs file as a MeasuredRun; RunsFileError on the first bad row."""
    path = Path(path)
    cmap = columns or ColumnMap()
    if not path.is_file():
        raise RunsFileError(f"runs file {path} does not exist (a CSV with config-key columns "
                            "and step_time_s or step_time_ms)")
    try:
        with path.open(newline="", encoding="utf-8-sig") as fh:
            rows = list(csv.reader(fh))
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise RunsFileError(f"runs file {path} cannot be read as CSV ({err})") from None
    if not rows:
        raise RunsFileError(f"runs file {path} is empty")
    header = [cmap.columns.get(h.strip(), h.strip()) for h in rows[0]]
    for h in header:
        _check_key(h, f"runs file {path} header")
    missing = [c for c in cmap.columns.values() if c not in header]
    if missing:
        raise RunsFileError(f"runs file {path} has no column for {missing} (the column map "
                            "names them); check the header")
    times = [h for h in header if h in TIME_COLUMNS]
    if len(times) != 1:
        raise RunsFileError(f"runs file {path} needs exactly one of {', '.join(TIME_COLUMNS)} "
                            f"(found {times or 'none'}); map the measured column with "
                            "columns: {'YOUR COLUMN': step_time_ms}")
    out = []
    for i, row in enumerate(rows[1:], start=2):
        if not any(c.strip() for c in row):
            continue
        where = f"runs file {path} line {i}"
        if len(row) != len(header):
            raise RunsFileError(f"{where}: {len(row)} values for {len(header)} columns")
        # an empty cell leaves that key to the presets (a column that applies to some rows only)
        values = {h: _number(v) for h, v in zip(header, row) if v.strip() or h in times}
        t = values.pop(times[0])
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t <= 0:
            raise RunsFileError(f"{where}: {times[0]}={t!r} must be a positive number")
        name = str(values.pop("name", "") or "")
        kinds = {}
        for col in [h for h in header if h in KIND_COLUMNS and h in values]:
            v = values.pop(col)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
                raise RunsFileError(f"{where}: {col}={v!r} must be a positive number of seconds "
                                    "(or empty: not measured)")
            kinds[KIND_COLUMNS[col]] = float(v)
        values.update(cmap.set)
        for key, expr in cmap.derive.items():
            try:
                values[key] = evaluate(expr, values)
            except KeyError as err:
                raise RunsFileError(f"{where}: derive {key} = {expr} needs {err.args[0]}, which "
                                    "the row does not have") from None
            except (ValueError, ZeroDivisionError, SyntaxError) as err:
                raise RunsFileError(f"{where}: derive {key} = {expr}: {err}") from None
        out.append(MeasuredRun(i, values, float(t) * TIME_COLUMNS[times[0]], name, kinds))
    if not out:
        raise RunsFileError(f"runs file {path} has a header but no rows")
    return out
