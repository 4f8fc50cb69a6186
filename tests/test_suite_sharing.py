"""The xdist scheduler's reading of the sources (tests/conftest.py) picks out exactly the
tests pytest sees marked ``multiprocess``: none runs beside another rank-spawning test, and
no single-process test waits behind them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import spawns_ranks

ROOT = Path(__file__).resolve().parents[1]
LISTER = '''
def pytest_collection_finish(session):
    for item in session.items:
        mark = item.get_closest_marker("multiprocess") is not None
        print("ITEM", int(mark), item.nodeid)
'''


def test_the_sources_name_exactly_the_tests_marked_multiprocess(tmp_path):
    (tmp_path / "lister.py").write_text(LISTER)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    out = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", "-n", "0", "-p", "lister"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    rows = [line.split(" ", 2)[1:] for line in out.stdout.splitlines() if line.startswith("ITEM ")]
    assert len(rows) > 1000, out.stdout[-2000:] + out.stderr[-2000:]
    marked = {nodeid for flag, nodeid in rows if flag == "1"}
    read = {nodeid for _, nodeid in rows if spawns_ranks(nodeid)}
    assert marked and read == marked, sorted(read ^ marked)


def test_a_module_mark_covers_its_tests_and_parameters_are_read_by_function():
    assert spawns_ranks("tests/executor/test_faults.py::anything")
    assert spawns_ranks("tests/cli/test_bad_inputs.py::test_seconds_may_be_fractional")
    assert not spawns_ranks("tests/cli/test_bad_inputs.py::test_name_too_long")
    assert spawns_ranks("tests/conformance/test_conformance.py::"
                        "test_pytorch_issues_what_the_schedule_says_and_trains_alike[ddp]")
    assert not spawns_ranks("tests/sim/test_twin.py::test_x")
