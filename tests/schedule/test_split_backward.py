"""Programs of split-backward pipelines (ZB-H1, ZB-V, DualPipeV) and torch CSV tables: I then W,
gradient sync after W, the same ops as the unsplit backward, V placement, CSV round trips."""

from __future__ import annotations

import warnings
from collections import Counter

import pytest

from tests.conftest import cluster, gpt
from twin.schedule.builder import build_program, build_schedule
from twin.schedule.check import check_schedule, memory_peak
from twin.schedule.pipeline import Overlapped
from twin.schedule.tables import job_tables, stage_table
from twin.schedule.torchcsv import check_orders, format_csv, parse_csv
from twin.schedule.zerobubble import post_recvs
from twin.spec import ConfigError, ParallelPlan, build_job
from twin.workload.memory import rank_memory


def job(pp=2, dp=2, sched="zb_h1", v=1, m=8, model=None, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = ParallelPlan(pp=pp, dp=dp, pp_schedule=sched, pp_virtual_stages=v,
                            global_batch_size=m * dp, **kw)
        return build_job(model or gpt(), cluster(gpus=pp * dp * plan.tp), plan)


def names(prog):
    return [op.name for op in prog.ops]


def test_w_ops_wait_for_the_w_action_and_i_ops_are_sent_at_once():
    """ZB-H1 on the last of 2 stages: F0 I0 F1 I1 W0 ...: mb 0's weight gradients come
    after mb 1's input gradients, and each I's gradient is sent before the next forward."""
    prog = build_program(job(dp=1), 1)
    n = names(prog)
    w0 = min(i for i, x in enumerate(n) if x.startswith("bwd/mb0/") and x.endswith(".wgrad"))
    i1 = max(i for i, x in enumerate(n) if x.startswith("bwd/mb1/") and x.endswith(".dgrad"))
    assert w0 > i1
    send0 = n.index("bwd/mb0/c1/send")
    assert send0 < min(i for i, x in enumerate(n) if x.startswith("fwd/mb2/"))
    assert all(not x.endswith(".wgrad") for x in n[:send0])


@pytest.mark.parametrize("zero", [0, 2])
def test_gradient_sync_follows_the_w_ops(zero):
    """DDP buckets (all-reduce) and ZeRO-2 reduce-scatters are issued after the W ops
    whose gradients they carry, and wait for them."""
    j = job(zero_stage=zero, ddp_bucket_MB=1)
    for rank in (0, 1):
        prog = build_program(j, j.grid.rank(pp=rank))
        syncs = [i for i, op in enumerate(prog.ops) if op.group_name == "dp" and op.is_collective
                 and op.phase == "bwd"]
        assert syncs
        for i in syncs:
            deps = [prog.ops[d].name for d in prog.ops[i].deps]
            assert any(d.endswith(".wgrad") or d.endswith("embed.bwd") for d in deps), deps
            w = max(d for d in prog.ops[i].deps)
            assert prog.ops[w].mb == prog.ops[i].mb


@pytest.mark.parametrize("split, whole, v", [("zb_h1", "1f1b", 1), ("dualpipev", "zb_v", 2)])
def test_a_split_backward_runs_the_same_ops_in_another_order(split, whole, v):
    a, b = job(sched=split, v=v), job(sched=whole, v=v)
    for rank in range(a.grid.world_size):
        pa, pb = build_program(a, rank), build_program(b, rank)
        assert Counter(names(pa)) == Counter(names(pb))
        assert sum(op.flops for op in pa.ops) == pytest.approx(sum(op.flops for op in pb.ops))


@pytest.mark.parametrize("sched, v", [("zb_h1", 1), ("zb_v", 2), ("dualpipev", 2)])
@pytest.mark.parametrize("pp, extra", [(2, {}), (4, {}), (2, {"recompute": "selective"}),
                                       (2, {"recompute": "full"}), (4, {"recompute": "full"}),
                                       (2, {"tp": 2, "sp": True, "zero_stage": 1})])
def test_split_programs_check_and_memory_agrees_with_the_static_model(sched, v, pp, extra):
    """Deadlock free, collectives in order, sends paired in order; the walked peak of the
    memory ops equals rank_memory's tensors (activations held from F to W; under full
    recomputation the recomputed layers from I to W)."""
    j = job(pp=pp, sched=sched, v=v, m=2 * pp + 2, model=gpt(dropout=0.0), **extra)
    sched_ = build_schedule(j)
    check_schedule(sched_.programs())
    for stage in range(pp):
        rank = j.grid.rank(pp=stage)
        peak, _ = memory_peak(sched_.program(rank))
        assert peak == pytest.approx(rank_memory(j, rank).tensors, rel=0.01)


def test_v_placement_keeps_the_head_on_rank_0_and_hands_over_locally():
    j = job(pp=4, dp=1, sched="zb_v", v=2, model=gpt(tie_embeddings=True))
    assert j.placement == (0, 1, 2, 3, 3, 2, 1, 0) and j.head_stage == 0
    last = build_program(j, 3)
    assert not [op for op in last.ops if op.kind in ("send", "recv") and ".c3." in op.tag
                and op.peer == 3]
    tags = {op.tag for op in last.ops if op.kind == "send"}
    assert "act.c3.mb0" not in tags and "act.c4.mb0" in tags  # the turn is local
    first = build_program(j, 0)
    assert any(op.name.endswith("lm_head") for op in first.ops)
    assert not any(op.group_name == "embd" for op in first.ops)  # one rank holds both


# -- torch CSV tables --------------------------------------------------------------------------

@pytest.mark.parametrize("sched, v, p, m", [("zb_h1", 1, 4, 8), ("zb_v", 2, 4, 9),
                                            ("dualpipev", 2, 4, 8), ("interleaved", 2, 2, 4),
                                            ("1f1b", 1, 3, 5)])
def test_csv_round_trip(sched, v, p, m):
    orders = [stage_table(sched, p, m, s, v) for s in range(p)]
    back = parse_csv(format_csv(orders))
    assert back == orders
    assert [[a.overlap for a in o] for o in back] == [[a.overlap for a in o] for o in orders]
    assert check_orders(back, p, p * v).microbatches == m


def test_dualpipev_pairs_are_one_cell():
    text = format_csv([stage_table("dualpipev", 2, 4, s, 2) for s in range(2)])
    assert "(0F3;3B1)OVERLAP_F_B" in text.splitlines()[0]
    assert parse_csv("(0F2;3B0)OVERLAP_F_B")[0] == [Overlapped("F", 2, 0), ("B", 0, 3)]


@pytest.mark.parametrize("sched, v", [("zb_v", 2), ("dualpipev", 2), ("zb_h1", 1)])
def test_a_csv_table_builds_the_programs_of_its_schedule(sched, v, tmp_path):
    named = job(sched=sched, v=v)
    path = tmp_path / "t.csv"
    path.write_text(format_csv(job_tables(named)))
    from_csv = job(sched="1f1b", v=v, pp_schedule_csv=str(path))
    assert from_csv.placement == named.placement
    for rank in range(named.grid.world_size):
        assert build_program(from_csv, rank).ops == build_program(named, rank).ops


def test_torch_validates_and_lowers_our_tables_as_we_do():
    """torch 2.13's _validate_schedule accepts the CSV, and its _add_send_recv posts every
    recv where zerobubble.post_recvs does."""
    import csv
    import io

    S = pytest.importorskip("torch.distributed.pipelining.schedules")
    from twin.schedule.pipeline import chunk_stage

    for sched, v, p, m in (("zb_v", 2, 4, 9), ("dualpipev", 2, 3, 7), ("zb_h1", 1, 4, 6)):
        orders = [stage_table(sched, p, m, s, v) for s in range(p)]
        where = tuple(chunk_stage(c, p, "v" if v == 2 else "loop") for c in range(p * v))
        rows = csv.reader(io.StringIO(format_csv(orders)))
        actions = {r: [S._Action.from_str(c) for c in row] for r, row in enumerate(rows)}
        assert S._validate_schedule(actions, p, p * v, m) == dict(enumerate(where))
        lowered = S._add_send_recv(actions, stage_to_rank=where.__getitem__, num_stages=p * v)
        theirs = []
        for r in range(p):
            row = []
            for a in lowered[r]:
                t = a.computation_type
                if t in (S.RECV_F, S.RECV_B):
                    row.append(("recv", ("F" if t == S.RECV_F else "B", a.microbatch_index,
                                         a.stage_index)))
                elif t not in (S.SEND_F, S.SEND_B):
                    for x in a.sub_actions or (a,):
                        row.append(("act", (x.computation_type.value, x.microbatch_index,
                                            x.stage_index)))
            theirs.append(row)
        ours = [[(k, tuple(a)) for k, a in row] for row in post_recvs(orders, where)]
        assert ours == theirs


@pytest.mark.parametrize("text, match", [
    ("0F0,0B0,0F1,0B1\n1F0,1F1,1B0,1B1\n",
     r"deadlocks: row 0 blocks at action 1 \(0B0\), waiting for an input that never comes; "
     r"also blocked: row 1 at 1F1$"),
    ("0F0,0B0,0F1,0B1\n1F0,1B0,1F1,1B1\n1F2\n", r"has 3 rows but parallel.pp=2"),
    ("0F0,0X0\n1F0,1B0\n", r"row 0 cell 1: '0X0' is not a compute action"),
    ("0F0,0W0,0I0\n1F0,1B0\n", r"row 0: 0W0 comes before 0I0"),
    ("0F0,0B0\n1F0\n", r"micro-batch 0 of stage 1 has 1 F, 0 B, 0 I, 0 W"),
    ("0F0,0B0,1F0,1B0\n1F0,1B0\n", r"stage 1 runs on rows 0 and 1"),
])
def test_bad_csv_tables_fail_in_one_line(text, match):
    with pytest.raises(ConfigError, match=match) as err:
        check_orders(parse_csv(text), 2, 2)
    assert "\n" not in str(err.value)


def test_a_deadlocking_csv_is_refused_when_the_job_is_built(tmp_path):
    path = tmp_path / "dead.csv"
    path.write_text("0F0,0B0,0F1,0B1\n1F0,1F1,1B0,1B1\n")
    with pytest.raises(ConfigError, match="deadlocks: row 0 blocks at action 1 \\(0B0\\)"):
        job(dp=1, m=2, pp_schedule_csv=str(path))
    with pytest.raises(ConfigError, match="runs 2 micro-batches but the plan has 4"):
        path.write_text("0F0,0B0,0F1,0B1\n1F0,1B0,1F1,1B1\n")
        job(dp=1, m=4, pp_schedule_csv=str(path))


@pytest.mark.parametrize("kw, match", [
    (dict(sched="zb_v", v=1), r"pp_schedule=zb_v needs exactly 2 chunks per rank.*"
                              r"pp_virtual_stages=2"),
    (dict(sched="dualpipev", v=3), r"pp_schedule=dualpipev needs exactly 2 chunks"),
    (dict(sched="dualpipev", v=2, pp=4, m=6), r"needs at least 2 \* pp = 8 micro-batches"),
    (dict(sched="zb_h1", zero_stage=3), r"zero_stage=3 with a split-backward pipeline"),
    (dict(sched="zb_h1", v=2), r"pp_virtual_stages=2 needs pp_schedule=interleaved"),
])
def test_bad_split_plans_fail_in_one_line(kw, match):
    with pytest.raises(ConfigError, match=match) as err:
        job(**kw)
    assert "\n" not in str(err.value)


def test_the_twin_simulates_a_smaller_bubble_for_zero_bubble_schedules():
    """The twin (SimPy, real costs, p2p and all) on 4 stages of a GPT: ZB-H1 beats 1F1B,
    and ZB-V and DualPipeV beat interleaved 1F1B with two chunks, at the same work."""
    from twin.sim.run import simulate

    def step(sched, v):
        return simulate(job(pp=4, dp=1, sched=sched, v=v, m=16), trace="none").summary

    one, zb = step("1f1b", 1), step("zb_h1", 1)
    inter, zbv, dpv = step("interleaved", 2), step("zb_v", 2), step("dualpipev", 2)
    assert zb["step_time_s"] < one["step_time_s"]
    assert zb["bubble_fraction"] < one["bubble_fraction"]
    assert max(zbv["step_time_s"], dpv["step_time_s"]) < inter["step_time_s"]
