"""The GPU kernel sweep's timing, run on CPU with a stand-in torch.cuda: calls queued behind a
sleeping kernel, each timed by its events, the host's time apart; a sleep too short for the
host to queue every call is lengthened and tried again, and said when it never was."""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")

from executor.bench import kernels as bench  # noqa: E402


class FakeCuda:
    """Events stamped by a GPU clock the fake advances by each kernel's time; the sleep ends
    at ``wake``; ``query`` of the gate says whether the GPU woke before the host was done."""

    def __init__(self, sleep=True, covers_from=0):
        self.clock, self.sleeps, self.covers_from = 0.0, [], covers_from
        if sleep:
            self._sleep = self.sleep

    def sleep(self, cycles):
        self.sleeps.append(cycles)

    def synchronize(self, device=None):
        pass

    def Event(self, enable_timing=False):  # noqa: N802 (torch's name)
        cuda = self

        class Ev:
            def record(self, stream=None):
                self.t = cuda.clock

            def query(self):  # the gate: the GPU still asleep only from the covers_from'th try
                return len(cuda.sleeps) <= cuda.covers_from

            def elapsed_time(self, other):
                return (other.t - self.t) * 1e3  # ms

        return Ev()


class FakeKernels:
    device = types.SimpleNamespace(type="cuda")

    def __init__(self, cuda, seconds):
        self.cuda, self.seconds, self.calls = cuda, seconds, 0

    def run(self, op):
        self.calls += 1
        self.cuda.clock += self.seconds


def run(monkeypatch, cuda, repeats=4):
    monkeypatch.setattr(bench.torch, "cuda", cuda)
    logged = []
    k = FakeKernels(cuda, 2.5e-5)
    times, host = bench._time_cuda(k, types.SimpleNamespace(name="op"), repeats,
                                   types.SimpleNamespace(fill_=lambda v: None), logged.append)
    return times, host, logged, k


def test_each_call_is_timed_by_its_events_and_the_host_apart(monkeypatch):
    cuda = FakeCuda()
    times, host, logged, k = run(monkeypatch, cuda)
    assert times == pytest.approx([2.5e-5] * 4) and len(host) == 4 and all(h >= 0 for h in host)
    assert cuda.sleeps == [bench.SLEEP_CYCLES] and not logged and k.calls == 4


def test_a_sleep_too_short_is_lengthened_then_said(monkeypatch):
    cuda = FakeCuda(covers_from=1)  # the first sleep ends too soon, the second covers
    times, _, logged, k = run(monkeypatch, cuda)
    assert cuda.sleeps == [bench.SLEEP_CYCLES, 4 * bench.SLEEP_CYCLES] and not logged
    assert k.calls == 8 and len(times) == 4
    never = FakeCuda(covers_from=99)
    _, _, logged, k = run(monkeypatch, never)
    assert len(never.sleeps) == 3 and k.calls == 12 and "include the host's launch" in logged[0]


def test_without_a_sleep_kernel_it_times_once_and_says_so(monkeypatch):
    cuda = FakeCuda(sleep=False)
    times, _, logged, k = run(monkeypatch, cuda)
    assert k.calls == 4 and len(times) == 4 and "no torch.cuda._sleep" in logged[0]
