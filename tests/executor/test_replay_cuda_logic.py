"""The GPU replay's bookkeeping, run on CPU with stand-in CUDA streams and events.

This cannot show that NCCL and CUDA behave (CI has no GPU: benchmarks/gpu_calibration.py
does that); it shows that the CUDA path walks a whole program, orders streams with events,
times every op from its events and counts memory, without host-side waits.
"""

from __future__ import annotations

import contextlib
import time
import types

import pytest

torch = pytest.importorskip("torch")

from executor import replay_cuda  # noqa: E402
from tests.executor.test_replay_walk import FakeComms, program  # noqa: E402


class Event:
    def __init__(self, enable_timing=False):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter_ns()
        if stream is not None:
            stream.recorded.append(self)

    def query(self):
        return self.t is not None

    def elapsed_time(self, other):
        return (other.t - self.t) / 1e6  # ms, as CUDA reports


class Stream:
    def __init__(self, device=None):
        self.waits, self.recorded = [], []

    def wait_event(self, ev):
        assert ev.t is not None, "a stream waits for an event never recorded"
        self.waits.append(ev)


def fake_torch(default: Stream):
    cuda = types.SimpleNamespace(
        Event=Event, Stream=Stream, synchronize=lambda device=None: None,
        current_stream=lambda device=None: default,
        stream=lambda s: contextlib.nullcontext())
    return types.SimpleNamespace(cuda=cuda)


def test_cuda_path_times_every_op_from_events(monkeypatch):
    default = Stream()
    monkeypatch.setattr(replay_cuda, "torch", fake_torch(default))
    comms = FakeComms()
    for w in ("allreduce",):  # works are waited on a stream, never by the host
        orig = getattr(comms.comm, w)

        def issue(tensors, orig=orig):
            work = orig(tensors)
            work.wait = lambda: None
            return work

        setattr(comms.comm, w, issue)
    prog = program()
    rep = replay_cuda.CudaReplayer(prog, comms, torch.device("cpu"))
    result = rep.run_step(0)
    assert len(result.times) == len(prog.ops)
    assert all(0 <= s <= e for s, e in result.times)
    names = [op.name for op in prog.ops]
    t = dict(zip(names, result.times))
    assert t["free.a"][0] >= t["X"][1]  # a memory op is stamped no earlier than its deps
    # C (compute) waits for Y on the compute stream; Y's side stream waited for its deps
    assert any(ev is rep._ev_end[names.index("Y")] for ev in default.waits)
    side = rep._side[("comm", (0, 1))]
    assert rep._ev_end[names.index("A")] in side.waits
    # the count lies between the program-order peak (a freed before b) and both at once
    assert 1000 <= result.peak_bytes <= 1500 and not rep._issued and not rep._mem_pending
    assert 0 < result.issued_ns and set(result.host_ns_by_kind) <= {op.kind for op in prog.ops}
    assert 0 < sum(result.host_ns_by_kind.values()) <= result.issued_ns
    # a second step records the same events again (made once per op, not per record)
    first = {i: (rep._ev_start[i], rep._ev_end[i]) for i in range(len(prog.ops))}
    again = rep.run_step(1)
    assert all(rep._ev_start[i] is s and rep._ev_end[i] is e for i, (s, e) in first.items())
    assert len(again.times) == len(prog.ops) and all(0 <= s <= e for s, e in again.times)
