"""Every collective kind of the IR, on overlapping groups of 4 real ranks, with verified results."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from executor.launch import launch_local  # noqa: E402
from twin import rundir  # noqa: E402
from twin.schedule.ir import COLLECTIVE_KINDS, Op, Program, Schedule  # noqa: E402
from twin.spec import ClusterSpec, GPUSpec, ModelSpec, ParallelPlan, build_job  # noqa: E402
from twin.trace import Trace  # noqa: E402

GROUPS = {"comm.tp": [(0, 1), (2, 3)], "comm": [(0, 2), (1, 3)], "comm.ag": [(0, 1, 2, 3)]}


def programs() -> dict[int, Program]:
    """Each kind on each stream's groups (roots vary), a GEMM between, and p2p both ways."""
    ops: dict[int, list[Op]] = {r: [] for r in range(4)}
    for kind in COLLECTIVE_KINDS:
        for stream, groups in GROUPS.items():
            for g in groups:
                root = g[-1] if kind in ("broadcast", "reduce", "gather", "scatter") else -1
                for r in g:
                    prev = len(ops[r]) - 1
                    ops[r].append(Op(f"{kind}/{stream}/{'-'.join(map(str, g))}", kind, stream,
                                     deps=(prev,) if prev >= 0 else (), group=g, root=root,
                                     bytes=4096 * len(g), dtype="fp32",
                                     group_name=stream.split(".")[-1]))
        for r in range(4):
            ops[r].append(Op(f"gemm.after.{kind}", "gemm", "compute", deps=(len(ops[r]) - 1,),
                             shape=(32, 32, 32), dtype="fp32", flops=65536.0))
    for src, dst in ((0, 3), (3, 0), (1, 2)):
        tag = f"msg.{src}.{dst}"
        ops[src].append(Op(f"send.{tag}", "send", "p2p", deps=(len(ops[src]) - 1,), peer=dst,
                           tag=tag, bytes=1000, dtype="fp32", group_name="pp"))
        ops[dst].append(Op(f"recv.{tag}", "recv", "p2p", peer=src, tag=tag, bytes=1000,
                           dtype="fp32", group_name="pp"))
    return {r: Program(r, o) for r, o in ops.items()}


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_every_kind_on_overlapping_groups_is_correct(tmp_path):
    model = ModelSpec(name="tiny", num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2,
                      ffn_hidden_size=128, vocab_size=512, seq_len=64, activation="swiglu",
                      dtype="fp32")
    cluster = ClusterSpec(name="cpu", num_nodes=1, gpus_per_node=4,
                          gpu=GPUSpec(name="cpu", peak_tflops={"fp32": 0.1}))
    job = build_job(model, cluster, ParallelPlan(tp=2, pp=2))
    progs = programs()
    run_dir = rundir.prepare(tmp_path / "kinds")
    Schedule(job, programs=progs).save(run_dir / rundir.SCHEDULE)
    rundir.write_json(run_dir / rundir.SETTINGS, {
        "task": "replay", "world_size": 4, "steps": 1, "warmup": 1, "timeout_s": 60,
        "comm_timeout_s": 150, "backend": "gloo", "threads": 1, "verify": True, "fault": None})
    launch_local(run_dir, 4, timeout_s=60, log=lambda m: None)
    trace = Trace.load(run_dir / rundir.TRACE)
    kinds = {s.kind for s in trace.spans}
    assert set(COLLECTIVE_KINDS) <= kinds and {"send", "recv"} <= kinds
    assert len(trace.spans) == sum(len(p.ops) for p in progs.values())
