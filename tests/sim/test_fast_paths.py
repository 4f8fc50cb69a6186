"""The hand-written fast paths give what the general code gives: moving the micro-batches an
op's name names (fastforward.moved, counterparts) as the pattern does, and an op built without the frozen
dataclass's __init__ (emit.make_op) equal to Op(...)."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest

from tests.conftest import cluster, gpt
from twin.schedule.builder import build_schedule
from twin.schedule.emit import make_op
from twin.schedule.ir import Op
from twin.schedule.names import moved
from twin.sim.counterparts import counterparts
from twin.spec import ParallelPlan, build_job


def _by_pattern(text: str, d: int) -> str:
    return re.sub(r"(?<![A-Za-z0-9_])mb([0-9]+)", lambda m: f"mb{int(m[1]) + d}", text)


@pytest.mark.parametrize("text", [
    "fwd/mb1/L0/qkv", "fwd/mb12/L0/qkv", "fwd/mb1/L0/alloc.act.L0.mb1", "xmb1/a", "a_mb1",
    "mb1", "mb10mb1", "mb1_x", "bwd/mb1/c0/send", "p2p.mb1.c0", "", "nothing here", "mb1/mb1",
    "fwd/mb1/L3/free.act.L3.mb12", "bwd/mb6/L37/free.gathered.37.fwd.mb11", "mb"])
def test_moved_moves_every_micro_batch_token_as_the_pattern_does(text):
    for d in (4, -1, 0, 30):
        assert moved(text, d) == _by_pattern(text, d)


def interleaved_job(global_batch_size: int):
    """A small TP2 PP2 interleaved job with full recompute (its warnings silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_job(gpt(num_layers=4), cluster(1, 8), ParallelPlan(
            tp=2, pp=2, pp_schedule="interleaved", pp_virtual_stages=2, recompute="full",
            global_batch_size=global_batch_size))


def test_counterparts_are_the_ops_renamed_d_micro_batches_on():
    job = interleaved_job(32)
    for rank in (0, 2):
        ops = build_schedule(job).program(rank).ops
        index = {op.name: i for i, op in enumerate(ops)}
        want = [index.get(_by_pattern(op.name, 2), -1) if op.mb >= 0 else -1
                for op in ops]
        got = counterparts(ops, 2)
        assert (got >= 0).sum() > len(ops) // 2
        assert np.array_equal(got, np.array(want))


def test_make_op_builds_the_op_the_dataclass_builds():
    fields = dict(deps=(1, 4), phase="bwd", paradigm="tp", layer=3, mb=7, chunk=1,
                  shape=(2, 3, 4), dtype="bf16", flops=1.5, bytes=2.5, group=(0, 1),
                  group_name="tp", root=0, peer=3, tag="t", category="activations",
                  send_splits=(1.0, 2.0), recv_splits=(2.0, 1.0))
    assert make_op("a", "gemm", "compute", **fields) == Op("a", "gemm", "compute", **fields)
    assert make_op("b", "alloc", "mem") == Op("b", "alloc", "mem")
    with pytest.raises(AttributeError):
        make_op("c", "gemm", "compute").name = "d"  # still frozen
