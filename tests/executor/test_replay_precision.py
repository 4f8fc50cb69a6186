"""FP8 GEMMs (torch._scaled_mm) and bf16 optimizer states replay for real, collectives verified."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from tests.executor.helpers import paratwin  # noqa: E402
from twin.schedule.ir import Schedule  # noqa: E402
from twin.trace import Trace  # noqa: E402


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_fp8_plan_replays_every_op(tmp_path):
    """(mxfp8 runs the same replay, FP8_GEMMS; cpu_local has no mxfp8 peak to ask for it.)"""
    out = tmp_path / "run"
    res = paratwin("execute", "parallel=fsdp", "model=tiny", "model.dtype=bf16", "cluster=cpu_local",
                   "parallel.float8=tensorwise", "parallel.optimizer_dtype=bf16", "steps=1",
                   "warmup=0", "verify=true", "timeout_s=60", "format=json", f"out_dir={out}",
                   timeout=140)
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["verify"] is True and summary["mfu"] > 0
    programs = Schedule.load(out / "schedule.json").programs()
    fp8 = [op.name for p in programs.values() for op in p.ops
           if op.kind == "gemm" and op.dtype in ("fp8", "mxfp8")]
    assert fp8, "no FP8 GEMM in the schedule"
    names = {(s.rank, s.op) for s in Trace.load(out / "spans.json").spans}
    assert all((r, op.name) in names for r, p in programs.items() for op in p.ops)
