"""The recorder sees every route into a ProcessGroup and counts bytes the nccl-tests way."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

SCRIPT = textwrap.dedent("""
    import datetime, json, os, sys, tempfile
    import torch, torch.distributed as dist
    import torch.distributed._functional_collectives as fc
    from executor.conformance.capture import Recorder

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    rec = Recorder(0).install()
    sub = dist.new_group([0])
    x = torch.ones(10)
    dist.all_reduce(x)                                 # before recording: not kept
    rec.active = True
    rec.label(0, "fwd")
    dist.all_reduce(x)                                 # Python API
    dist.all_gather_into_tensor(torch.empty(10), x)   # gathered output counts
    dist.reduce_scatter_tensor(torch.empty(10), x)    # full input counts
    dist.broadcast(x, 0, group=sub)
    rec.label(0, "bwd")
    y = fc.all_reduce(x, "sum", sub) + 0               # functional collective (DTensor's route)
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4, bias=False))
    rec.label(1, "bwd")
    ddp(torch.ones(2, 4)).sum().backward()             # DDP's C++ Reducer
    rec.active = False
    dist.all_reduce(x)                                 # after recording: not kept
    print(json.dumps(rec.to_dicts()))
    dist.destroy_process_group()
""")


@pytest.mark.timeout(120)
def test_python_api_functional_collectives_and_the_ddp_reducer_are_all_recorded():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=100, check=True)
    import json

    calls = json.loads(out.stdout.strip().splitlines()[-1])
    got = [(c["step"], c["phase"], c["kind"], c["bytes"], tuple(c["group"])) for c in calls]
    assert got[:5] == [(0, "fwd", "all_reduce", 40, (0,)), (0, "fwd", "all_gather", 40, (0,)),
                       (0, "fwd", "reduce_scatter", 40, (0,)), (0, "fwd", "broadcast", 40, (0,)),
                       (0, "bwd", "all_reduce", 40, (0,))]
    ddp = [g for g in got if g[0] == 1]
    # construction (step 0's label) verifies shapes and broadcasts; backward all-reduces a bucket
    assert ddp == [(1, "bwd", "all_reduce", 4 * 16, (0,))]
    assert [c["seq"] for c in calls] == list(range(len(calls)))
