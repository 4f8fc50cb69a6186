"""Shared fixtures: small specs that tests vary with dataclasses.replace; and how the suite
is shared by two xdist workers."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from twin.spec import ClusterSpec, GPUSpec, ModelSpec, ParallelPlan

_TESTS = Path(__file__).parent


def _marked(node) -> bool:
    """Whether a decorator or ``pytestmark`` expression names ``multiprocess``."""
    return any(isinstance(n, ast.Attribute) and n.attr == "multiprocess" for n in ast.walk(node))


def _rank_tests() -> dict[str, set[str] | None]:
    """The tests marked ``multiprocess``, read from the sources (the xdist controller, which
    shares the work out, collects nothing): per file as node ids begin, the test functions'
    names, or None for every test of a module whose ``pytestmark`` has it."""
    out: dict[str, set[str] | None] = {}
    root = _TESTS.parent
    for path in _TESTS.rglob("test_*.py"):
        text = path.read_text()
        if "multiprocess" not in text:
            continue
        tree, key = ast.parse(text), path.relative_to(root).as_posix()
        if any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark"
                                                 for t in n.targets) and _marked(n.value)
               for n in tree.body):
            out[key] = None
            continue
        names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)
                 and any(_marked(d) for d in n.decorator_list)}
        if names:
            out[key] = names
    return out


RANK_TESTS = _rank_tests()


def spawns_ranks(nodeid: str) -> bool:
    """Whether the test ``nodeid`` is marked ``multiprocess`` (see _rank_tests)."""
    path, _, rest = nodeid.partition("::")
    if path not in RANK_TESTS:
        return False
    names = RANK_TESTS[path]
    return names is None or rest.split("[", 1)[0] in names


def pytest_collection_modifyitems(items):
    """The tests that spawn ranks first, so that one worker starts on them at once."""
    items.sort(key=lambda item: not spawns_ranks(item.nodeid))


try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # without pytest-xdist the suite runs in one process
    pass
else:
    class RanksOnOneWorker(LoadScopeScheduling):
        """The tests that spawn torch.distributed ranks (marked ``multiprocess``) run one
        after another on one worker; every other test is a unit of its own for whichever
        worker is free. The machine has 2 cores: two rank-spawning tests at once would run
        4-8 ranks on them and time collectives out; one beside a single-process test is what
        the cores take. (xdist's ``--dist loadgroup`` would do this with ``xdist_group``
        marks, but under pytest 9.2 the group never reaches its node ids: pytest-xdist
        issue 1386, open.)"""

        def _split_scope(self, nodeid: str) -> str:
            return "ranks" if spawns_ranks(nodeid) else nodeid

    def pytest_xdist_make_scheduler(config, log):
        return RanksOnOneWorker(config, log)


def gpt(**kw) -> ModelSpec:
    """A GPT-style model (MHA, f = 4h, LayerNorm, biases, dropout)."""
    base = dict(name="gpt", num_layers=8, hidden_size=256, num_heads=8, num_kv_heads=8,
                ffn_hidden_size=1024, vocab_size=1000, seq_len=128, activation="gelu",
                dtype="bf16")
    base.update(kw)
    return ModelSpec(**base)


def cluster(nodes: int = 1, gpus: int = 8, **kw) -> ClusterSpec:
    """A DGX-like cluster with the given shape."""
    return ClusterSpec(name="test", num_nodes=nodes, gpus_per_node=gpus,
                       gpu=GPUSpec(name="g", peak_tflops={"bf16": 100.0, "fp32": 10.0}), **kw)


@pytest.fixture
def model() -> ModelSpec:
    return gpt()


@pytest.fixture
def plan() -> ParallelPlan:
    return ParallelPlan()
