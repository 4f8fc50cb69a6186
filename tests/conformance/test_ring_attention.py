"""Plain-PyTorch ring attention (executor/conformance/ring.py) on real gloo ranks: its output
and gradients equal single-process causal attention, and the send/recv calls it issues (at
the c10d dispatcher) equal the schedule's CP ops of one layer, count and bytes, per peer pair.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")

from executor.conformance.compare import Entry, table  # noqa: E402
from twin.schedule.builder import build_program  # noqa: E402
from twin.spec import ClusterSpec, GPUSpec, ModelSpec, ParallelPlan, build_job  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
B, HEADS, KV_HEADS, D, S = 2, 4, 2, 8, 32

SCRIPT = textwrap.dedent(f"""
    import datetime, json, sys
    import torch, torch.distributed as dist
    import torch.nn.functional as F
    from executor.conformance.capture import Recorder
    from executor.conformance.ring import ring_attention, shard

    rank, world, store_path, balance = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    rec = Recorder(rank).install()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn({B}, {HEADS}, {S}, {D}, generator=gen, dtype=torch.float64)
    k = torch.randn({B}, {KV_HEADS}, {S}, {D}, generator=gen, dtype=torch.float64)
    v = torch.randn({B}, {KV_HEADS}, {S}, {D}, generator=gen, dtype=torch.float64)
    dout = torch.randn({B}, {HEADS}, {S}, {D}, generator=gen, dtype=torch.float64)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=True)
    out.backward(dout)
    mine = [shard(t, world, rank, balance).float().requires_grad_() for t in (q, k, v)]
    rec.active = True
    rec.label(0, "fwd")
    got = ring_attention(*mine, dist.group.WORLD, balance)
    rec.label(0, "bwd")
    got.backward(shard(dout, world, rank, balance).float())
    rec.active = False
    want = [shard(t, world, rank, balance) for t in (out, *(r.grad for r in ref))]
    err = max(float((a.double() - b).abs().max())
              for a, b in zip([got, *(m.grad for m in mine)], want))
    print(json.dumps({{"err": err, "calls": rec.to_dicts()}}))
    dist.destroy_process_group()
""")


def run_ranks(world: int, balance: str, tmp_path, timeout: float = 90) -> list[dict]:
    """``world`` rank processes over a FileStore (no port to collide on), each in its own
    session; every one still running at ``timeout`` is killed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    store = tmp_path / "store"
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, str(r), str(world), str(store),
                               balance], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env, cwd=ROOT, start_new_session=True) for r in range(world)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, err[-2000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    return outs


def schedule_layer(world: int, balance: str, rank: int, phase: str) -> dict:
    """The schedule's CP send/recv of layer 0 on ``rank``, as (pair, kind) -> (count, bytes)."""
    model = ModelSpec(name="ring", num_layers=1, hidden_size=HEADS * D, num_heads=HEADS,
                      num_kv_heads=KV_HEADS, ffn_hidden_size=64, vocab_size=64, seq_len=S,
                      activation="swiglu", dtype="fp32")
    cluster = ClusterSpec(name="cpu", num_nodes=1, gpus_per_node=world,
                          gpu=GPUSpec(name="cpu", peak_tflops={"fp32": 0.1}))
    job = build_job(model, cluster, ParallelPlan(cp=world, cp_load_balance=balance,
                                                 micro_batch_size=B))
    ops = [op for op in build_program(job, rank).ops
           if op.group_name == "cp" and op.layer == 0 and op.phase == phase]
    return table([Entry(tuple(sorted((rank, op.peer))), op.kind, int(op.bytes)) for op in ops])


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize("world, balance", [(2, "headtail"), (4, "headtail"), (4, "none")])
def test_ring_attention_is_exact_and_its_p2p_is_the_schedules(world, balance, tmp_path):
    results = run_ranks(world, balance, tmp_path)
    for rank, res in enumerate(results):
        assert res["err"] < 1e-4, (rank, res["err"])
        for phase in ("fwd", "bwd"):
            got = table([Entry(tuple(sorted((rank, c["peer"]))), c["kind"], c["bytes"])
                         for c in res["calls"] if c["phase"] == phase])
            assert got == schedule_layer(world, balance, rank, phase), (rank, phase)
