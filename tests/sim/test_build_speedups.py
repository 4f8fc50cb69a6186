"""Stamped layer bodies (twin/schedule/stamp.py) build the programs the generic code builds,
op for op and field for field, and the simulated steps take the same time."""

from __future__ import annotations

import dataclasses
import re
import warnings

import numpy as np
import pytest

from tests.conftest import cluster, gpt
from tests.sim.test_fast_paths import interleaved_job
from twin.schedule import stamp
from twin.schedule.builder import build_schedule
from twin.schedule.ir import Op
from twin.schedule.names import joined, mb_tokens
from twin.sim.counterparts import counterparts
from twin.sim.engine import SimOptions
from twin.sim.run import simulate
from twin.sim.spans import rank_spans
from twin.spec import GPUSpec, ParallelPlan, build_job
from twin.spec.moe import MoESpec
from twin.trace import Span

H100 = GPUSpec(name="H100", peak_tflops={"bf16": 989.0, "fp8": 1979.0, "fp32": 67.0})
MOE = dict(activation="swiglu", moe=MoESpec(num_experts=8, experts_per_token=2,
                                            moe_ffn_hidden_size=512, first_k_dense=1))

PLANS = {  # name: (plan, model overrides, GPUs)
    "ddp": (dict(global_batch_size=16), {}, 4),
    "zero1 sp tp2": (dict(tp=2, sp=True, zero_stage=1, global_batch_size=8), {}, 8),
    "fsdp": (dict(zero_stage=3, global_batch_size=8), {}, 4),
    "tp4 pp2 1f1b full": (dict(tp=4, pp=2, recompute="full", global_batch_size=8), {}, 8),
    "interleaved selective gqa rope": (
        dict(tp=2, pp=2, pp_schedule="interleaved", pp_virtual_stages=2, recompute="selective",
             global_batch_size=16),
        dict(num_kv_heads=2, position_embedding="rope", activation="swiglu"), 8),
    "interleaved full sp": (
        dict(tp=2, sp=True, pp=2, pp_schedule="interleaved", pp_virtual_stages=2,
             recompute="full", global_batch_size=16), {}, 8),
    "gpipe eager": (dict(pp=4, pp_schedule="gpipe", flash_attention=False, global_batch_size=8),
                    {}, 4),
    "moe ep2": (dict(ep=2, global_batch_size=8), MOE, 4),
    "async tp": (dict(tp=4, sp=True, async_tp=True, compile=True, global_batch_size=4),
                 dict(activation="swiglu"), 8),
    "zb_h1": (dict(pp=2, pp_schedule="zb_h1", global_batch_size=16), {}, 4),
    "zb_v full": (dict(pp=2, pp_schedule="zb_v", pp_virtual_stages=2, recompute="full",
                       global_batch_size=16), {}, 4),
    "fp8 tp2": (dict(tp=2, float8="tensorwise", recompute="full", global_batch_size=8), {}, 8),
    "op sac tp2 sp": (dict(tp=2, sp=True, recompute="op", global_batch_size=8),
                      dict(activation="swiglu", position_embedding="rope"), 8),
    "full early stop tp2 pp2": (dict(tp=2, pp=2, recompute="full", recompute_early_stop=True,
                                     global_batch_size=8), {}, 8),
    # whole actions stamped (twin/schedule/actions.py): stages of layers only, many micro-batches
    "1f1b pp4 ddp selective": (dict(pp=4, recompute="selective", global_batch_size=32),
                               dict(num_layers=8), 8),
    "interleaved pp4 zero2 full": (dict(pp=4, pp_schedule="interleaved", pp_virtual_stages=2,
                                        zero_stage=2, recompute="full", global_batch_size=32),
                                   dict(num_layers=16), 8),
    "1f1b pp4 op sac tp2 sp": (dict(tp=2, sp=True, pp=4, recompute="op", global_batch_size=16),
                               dict(num_layers=8, activation="swiglu"), 8),
    "interleaved pp4 async tp fp8": (
        dict(tp=2, sp=True, async_tp=True, compile=True, float8="tensorwise", pp=4,
             pp_schedule="interleaved", pp_virtual_stages=2, global_batch_size=16),
        dict(num_layers=16, activation="swiglu"), 8),
}


def _job(name: str):
    plan, model, gpus = PLANS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec = cluster(gpus=gpus)
        if plan.get("float8", "none") != "none":
            spec = dataclasses.replace(spec, gpu=H100)
        return build_job(gpt(**{"num_layers": 4, **model}), spec, ParallelPlan(**plan))


@pytest.fixture(autouse=True)
def short_runs_stamp_actions(monkeypatch):
    """Record whole actions however few micro-batches follow (actions.AHEAD): these runs are
    short, and the records are what is tested."""
    from twin.schedule import actions

    monkeypatch.setattr(actions, "AHEAD", 0)


@pytest.fixture
def stamps(monkeypatch):
    def use(on: bool) -> None:
        monkeypatch.setattr(stamp, "ENABLED", on)
    return use


def _fields(op: Op) -> tuple:
    return tuple(getattr(op, f.name) for f in dataclasses.fields(Op))


@pytest.mark.parametrize("name", PLANS)
def test_stamped_programs_are_the_generic_programs(name, stamps):
    job = _job(name)
    built = {}
    for on in (True, False):
        stamps(on)
        built[on] = build_schedule(job).programs()
    for rank, prog in built[False].items():
        got = built[True][rank].ops
        assert len(got) == len(prog.ops), rank
        for a, b in zip(got, prog.ops):
            assert type(a) is Op and _fields(a) == _fields(b), (rank, b.name)


@pytest.mark.parametrize("name", ["tp4 pp2 1f1b full", "interleaved selective gqa rope",
                                  "interleaved full sp", "moe ep2", "zb_v full", "fp8 tp2",
                                  "async tp", "1f1b pp4 ddp selective",
                                  "interleaved pp4 zero2 full", "1f1b pp4 op sac tp2 sp",
                                  "interleaved pp4 async tp fp8"])
def test_stamped_programs_simulate_to_the_same_step(name, stamps):
    job = _job(name)
    times = {}
    for on in (True, False):
        stamps(on)
        res = simulate(job, None, SimOptions(fold="auto"), trace="none")
        times[on] = res.summary["step_time_s"]
    assert times[True] == pytest.approx(times[False], rel=1e-12)


def test_stamps_are_used():
    job = _job("tp4 pp2 1f1b full")
    from twin.schedule.step import StepBuilder

    builder = StepBuilder(job, 0)
    builder.build()
    stamper = builder.tp.stamper
    assert stamper.checked and all(stamper.templates[k] is not None for k in stamper.checked)


def test_async_tp_bodies_are_stamped_with_their_copies_tagged_by_their_own_prefix():
    """Async TP's copies are tagged by their body's name (``fwd/mb3/L1/ag1.s0``): the record
    keeps the tag past the prefix, so later bodies are stamped, each copy tagged by its own
    body (and paired with its peer's copy of the same body)."""
    job = _job("async tp")
    for prog in build_schedule(job).programs().values():
        assert len({b[4] for b in prog.blocks}) >= 2  # micro-batches past the first's bodies
        for t, _phase, _layer, _chunk, _mb, base in prog.blocks:
            copies = [op for op in prog.ops[base:base + t.size] if op.kind in ("send", "recv")]
            assert copies
            for op in copies:
                prefix = op.name.rsplit("/", 1)[0] + "/"
                assert type(op.tag) is str and op.tag.startswith(prefix)


def test_a_body_that_differs_from_its_stamp_stays_generic():
    """A body whose ops depend on the micro-batch (no layer body does) fails the check of its
    second occurrence and is built by the generic code from then on."""
    from twin.schedule.emit import Ctx, ProgramBuilder
    from twin.schedule.stamp import Stamper

    b = ProgramBuilder(_job("ddp"), 0)
    stamper = Stamper(b)

    def body(ctx, x):
        y = b.elementwise(ctx, "a", 8, [x])
        return b.elementwise(ctx, "b", 8 * (1 + ctx.mb % 2), [y])

    x = b.elementwise(Ctx("setup"), "x", 8, [])
    for mb in range(4):
        ctx = Ctx("fwd", mb=mb, layer=0)
        stamper("t", ctx, (x,), None, lambda ctx=ctx: body(ctx, x))
    assert [op.shape for op in b.ops[2::2]] == [(8,), (16,), (8,), (16,)]
    assert all(t is None for t in stamper.templates.values())


def _stamped_actions(monkeypatch) -> list[int]:
    """Counts the actions stamped whole (twin/schedule/actions.py) from now on."""
    from twin.schedule import actions

    stamped, stamp_action = [], actions.ActionStamper._stamp

    def counted(self, t, phase, mb, chunk, x):
        stamped.append(mb)
        return stamp_action(self, t, phase, mb, chunk, x)

    monkeypatch.setattr(actions.ActionStamper, "_stamp", counted)
    return stamped


def test_whole_actions_are_stamped(monkeypatch):
    """On a 1F1B pipeline of four stages with 16 micro-batches, the middle stages' forwards
    and backwards are stamped whole from their kind's third action on; the first and last
    stages' (embedding, head) and a syncing micro-batch's (DDP's last) are not."""
    from twin.schedule.step import StepBuilder

    job = _job("1f1b pp4 ddp selective")
    stamped = _stamped_actions(monkeypatch)
    for stage, expect in ((0, False), (1, True), (2, True), (3, False)):
        stamped.clear()
        builder = StepBuilder(job, job.grid.group(0, "pp")[stage])
        builder.build()
        assert bool(stamped) == expect, stage
        assert 15 not in stamped  # DDP's buckets go out in the last micro-batch
        if expect:
            assert len(stamped) >= 2 * 16 - 12  # all but each kind's first few
            assert all(t is not None for t in builder.actions.checked.values())


def test_an_action_that_differs_from_its_stamp_stays_generic(monkeypatch, stamps):
    """An action whose ops depend on the micro-batch beyond their labels (here the bytes of
    every activation alloc and free, which no pass does) fails every check of its kind and
    is built by the generic code: the programs are the generic code's."""
    from twin.schedule.emit import ProgramBuilder

    def uneven(plain):
        def emit(self, ctx, buffer, category, nbytes, deps=()):
            return plain(self, ctx, buffer, category, nbytes * (1 + ctx.mb % 2), deps)
        return emit

    for verb in ("alloc", "free"):
        monkeypatch.setattr(ProgramBuilder, verb, uneven(getattr(ProgramBuilder, verb)))
    stamped = _stamped_actions(monkeypatch)
    job = _job("1f1b pp4 ddp selective")
    built = {}
    for on in (True, False):
        stamps(on)
        built[on] = build_schedule(job).programs()
    assert not stamped
    for rank, prog in built[False].items():
        assert [_fields(op) for op in built[True][rank].ops] == [_fields(op) for op in prog.ops]


# -- the fast paths of the fast-forward and the trace, against their plain versions --------

def _moved_by_pattern(text: str, d: int) -> str:
    return re.sub(r"(?<![A-Za-z0-9_])mb([0-9]+)", lambda m: f"mb{int(m[1]) + d}", text)


@pytest.mark.parametrize("text", ["fwd/mb1/L0/qkv", "fwd/mb12/L0/qkv", "a_mb1", "xmb1/a", "mb1",
                                  "mb1_x", "mb10mb1", "mb1/mb1", "fwd/mb1/L3/free.act.L3.mb12",
                                  "", "nothing", "bwd/mb1/c0/alloc.act.L0.mb1", "mb", "mbx",
                                  "bwd/mb6/L37/free.gathered.37.fwd.mb11"])
def test_micro_batch_tokens_split_as_the_pattern_does(text):
    pieces, mbs = mb_tokens(text)
    assert len(pieces) == len(mbs) + 1
    for d in (0, 1, 12):
        assert joined(pieces, mbs, d) == _moved_by_pattern(text, d)


def _counterparts_by_pattern(ops, d: int) -> np.ndarray:
    index = {op.name: i for i, op in enumerate(ops)}
    return np.array([index.get(_moved_by_pattern(op.name, d), -1) if op.mb >= 0 else -1
                     for op in ops])


@pytest.mark.parametrize("name", ["interleaved full sp", "tp4 pp2 1f1b full", "zb_v full",
                                  "1f1b pp4 ddp selective", "interleaved pp4 async tp fp8"])
def test_counterparts_of_stamped_programs(name):
    job = _job(name)
    for prog in build_schedule(job).programs().values():
        for d in (1, 2):
            want = _counterparts_by_pattern(prog.ops, d)
            assert np.array_equal(counterparts(prog.ops, d), want)
            # the micro-batches bound skips the last d micro-batches' lookups, nothing else
            assert np.array_equal(counterparts(prog.ops, d, job.parallel.num_microbatches), want)
            # stamped bodies and actions map to their copies op for op, as their names do
            m = job.parallel.num_microbatches
            assert np.array_equal(counterparts(prog.ops, d, m, prog.blocks), want)
            assert np.array_equal(counterparts(prog.ops, d, None, prog.blocks), want)
        assert prog.blocks and {b[4] for b in prog.blocks} >= set(range(2, m))


def _spans_by_span_of(rank, ops, line, step, offset_s, moved):
    """twin.sim.spans.rank_spans as it was: Span.of, names renamed by the pattern."""
    start = ((offset_s + line.start_s) * 1e6).tolist()
    end = ((offset_s + line.end_s) * 1e6).tolist()
    out = []
    for k, i in enumerate(line.idx.tolist()):
        op = ops[i]
        dmb = int(moved[k]) if moved is not None and op.mb >= 0 else 0
        span = Span.of(op, rank, step, start[k], end[k])
        if dmb:
            span = dataclasses.replace(span, op=_moved_by_pattern(op.name, dmb), mb=op.mb + dmb,
                                       tag=_moved_by_pattern(op.tag, dmb))
        out.append(span)
    return out


def test_spans_of_a_fast_forwarded_step_are_span_of_renamed():
    job = interleaved_job(64)
    from twin.cost import default_cost_model
    from twin.sim.engine import fold_classes
    from twin.sim.stepsim import Stepper

    classes = fold_classes(job, "all")
    run = Stepper(job, default_cost_model(job.cluster), SimOptions(fold="all"), classes).step(0)
    assert run.cut is not None  # fast-forwarded: spans renamed
    for r, line in run.lines.items():
        moved = run.moved[r]
        got = list(rank_spans(r, run.programs[r].ops, line, 0, 0.5, moved))
        assert got == _spans_by_span_of(r, run.programs[r].ops, line, 0, 0.5, moved)


def test_a_programs_table_is_never_another_programs(monkeypatch):
    """A program without a template keys its OpTable by its ops list's id; ids are reused
    once a list is freed, so the cache holds the list and checks it is the same one (with
    every id made equal, a table of one program was served for another of its length)."""
    from twin.cost import default_cost_model
    from twin.schedule.ir import Program
    from twin.sim import stepsim

    job = build_job(gpt(), cluster(gpus=2), ParallelPlan(global_batch_size=2))
    stepper = stepsim.Stepper(job, default_cost_model(job.cluster), SimOptions(), {0: [0]})
    compute = [Op(name=f"c{i}", kind="gemm", stream="compute") for i in range(3)]
    memory = [Op(name=f"m{i}", kind="alloc", stream="mem") for i in range(3)]
    monkeypatch.setattr(stepsim, "id", lambda _: 7, raising=False)  # a reused id
    first = stepper.table(Program(0, compute))
    second = stepper.table(Program(1, memory))
    assert first.compute.all() and not second.compute.any()
