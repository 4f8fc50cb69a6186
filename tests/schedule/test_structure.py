"""The planner's shape: small modules with a one-line docstring, no import cycle, passes in order."""

from __future__ import annotations

import ast
from pathlib import Path

import twin.schedule.step as step
from tests.conftest import cluster, gpt
from twin.spec import ParallelPlan, build_job

SCHEDULE = Path(step.__file__).parent


def _imports(path: Path) -> set[str]:
    """twin.schedule modules imported by ``path`` (anywhere in it, lazily too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("twin.schedule."):
            out.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[2] for a in node.names if a.name.startswith("twin.schedule.")}
    return out


def test_schedule_modules_are_small_and_say_what_they_are_for():
    for path in SCHEDULE.glob("*.py"):
        text = path.read_text()
        assert len(text.splitlines()) <= 400, path.name
        doc = ast.get_docstring(ast.parse(text))
        assert doc and doc.splitlines()[0].strip(), f"{path.name} has no one-line docstring"


def test_schedule_modules_import_no_cycle():
    graph = {p.stem: _imports(p) for p in SCHEDULE.glob("*.py")}
    done: set[str] = set()

    def visit(mod: str, path: tuple[str, ...]) -> None:
        assert mod not in path, " -> ".join(path + (mod,))
        if mod in done:
            return
        for dep in graph.get(mod, ()):
            visit(dep, path + (mod,))
        done.add(mod)

    for mod in graph:
        visit(mod, ())


def test_passes_are_applied_in_torchtitans_order():
    """TP (the bodies), recomputation, DDP/ZeRO-1/2 or FSDP, then the pipeline."""
    names = {}
    for zero in (0, 3):
        job = build_job(gpt(), cluster(gpus=8), ParallelPlan(tp=2, pp=2, zero_stage=zero,
                                                             global_batch_size=8))
        names[zero] = [type(p).__name__ for p in step.StepBuilder(job, 0).passes]
    assert names == {0: ["TensorParallel", "Recompute", "GradSync", "Pipeline"],
                     3: ["TensorParallel", "Recompute", "FSDP", "Pipeline"]}
