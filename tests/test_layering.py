"""The package layering: paratwin (CLI) above executor above twin, imports only downward,
no import cycle between modules, no module over 400 lines, each with a docstring."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("twin", "executor", "paratwin")
LEVEL = {"twin": 0, "executor": 1, "paratwin": 2}
MAX_LINES = 400


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The project modules ``path`` imports (at any depth of the file: lazy imports count)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for n in names:
            while n and n not in known:
                n = n.rpartition(".")[0]
            if n and n != name:
                found.add(n)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {m: imports(p, m, known) for m, p in mods.items()}


def test_imports_go_only_downward():
    bad = []
    for mod, deps in graph().items():
        for d in deps:
            if LEVEL[d.split(".")[0]] > LEVEL[mod.split(".")[0]]:
                bad.append(f"{mod} imports {d}")
    assert not bad, "an import goes up the layers (twin < executor < paratwin):\n" + "\n".join(bad)


def test_libraries_do_not_import_hydra():
    bad = [m for m, p in modules().items() if m.split(".")[0] in ("twin", "executor")
           and ("import hydra" in p.read_text() or "from hydra" in p.read_text())]
    assert not bad, f"Hydra belongs to the CLI (paratwin/): {bad}"


def test_reports_only_draw():
    """The report reaches no simulator and computes no summary: what it draws was written by
    the runs (summary.json, modelled.csv) or handed in by the caller (the CLI)."""
    g = graph()
    seen: set[str] = set()
    todo = [m for m in g if m.startswith("twin.report")]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += g.get(m, ())
    bad = sorted(m for m in seen if m.startswith(("twin.sim", "twin.calibrate.predict")))
    assert not bad, f"twin.report reaches {bad}"
    text = "\n".join(p.read_text() for m, p in modules().items() if m.startswith("twin.report"))
    assert not re.search(r"from twin\.metrics import[^\n]*\bsummarize\b", text)


def test_no_import_cycle():
    g = graph()
    # package __init__ re-exports are edges too; a cycle through one is still a cycle
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(g.get(m, ())):
            if state.get(d) == 1 and not m.startswith(d + ".") and not d.startswith(m + "."):
                return stack[stack.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(g):
        if m not in state:
            cycle = visit(m)
            assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_modules_are_small_and_say_what_they_are_for():
    long = {m: n for m, p in modules().items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"
    bare = [m for m, p in modules().items() if p.read_text().strip()
            and ast.get_docstring(ast.parse(p.read_text())) is None]
    assert not bare, f"modules without a docstring: {bare}"
