"""Verification values prove a collective ran on the right group; sizes and busbw follow nccl-tests."""

from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")

from executor.collectives import (  # noqa: E402
    BufferPool,
    Issued,
    check,
    expected,
    p2p_tag,
    sent_value,
)
from twin.schedule.ir import COLLECTIVE_KINDS, Op  # noqa: E402
from twin.vocab import busbw_factor  # noqa: E402

PER = 3  # elements per chunk in these tests


def full(value: float, n: int = PER) -> torch.Tensor:
    return torch.full((n,), value, dtype=torch.float64)


def op_of(kind: str, group, root: int = -1, name: str = "fwd/L0/x") -> Op:
    return Op(name=name, kind=kind, stream="comm", group=tuple(group), root=root, bytes=4.0,
              dtype="fp32")


def simulate(op: Op, rank: int, members) -> torch.Tensor | None:
    """What ``rank`` would get if ``op`` really ran over ``members`` (root members[0] where
    rooted): the collective's semantics applied to the members' verification inputs."""
    n, g = len(members), members.index(rank)
    ran = Op(name=op.name, kind=op.kind, stream=op.stream, group=tuple(members),
             root=members[0] if op.root >= 0 else -1)

    def chunks(r):
        return [full(sent_value(ran, r, c)) for c in range(n)]

    k = op.kind
    if k == "all_reduce" or (k == "reduce" and g == 0):
        return sum(full(sent_value(ran, m)) for m in members)
    if k == "broadcast":
        return full(sent_value(ran, members[0]))
    if k == "all_gather" or (k == "gather" and g == 0):
        return torch.cat([full(sent_value(ran, m)) for m in members])
    if k == "reduce_scatter":
        return sum(chunks(m)[g] for m in members)
    if k == "all_to_all":
        return torch.cat([chunks(m)[g] for m in members])
    if k == "scatter":
        return chunks(members[0])[g]
    return None


def verdict(op: Op, rank: int, result) -> bool:
    try:
        check(op, rank, Issued(None, (), result))
    except AssertionError:
        return False
    return True


@pytest.mark.parametrize("kind", COLLECTIVE_KINDS)
def test_the_right_group_passes_and_a_mixed_up_group_fails(kind):
    """Every kind, in a world of 4: the result over the op's own group checks out; the result
    over another group of the same size (a group mix-up) or another root does not."""
    rooted = kind in ("broadcast", "reduce", "gather", "scatter")
    group = (0, 1)
    mixups = 0
    for rank in group:
        op = op_of(kind, group, root=0 if rooted else -1)
        want = simulate(op, rank, group)
        if want is None:
            continue  # this rank receives nothing (a non-root of reduce/gather)
        assert verdict(op, rank, want)
        if kind in ("broadcast", "scatter") and rank == 0:
            continue  # the root keeps its own data: no group can be told from it
        for other in itertools.combinations(range(4), 2):
            if other == group or rank not in other:
                continue
            wrong = simulate(op, rank, tuple(sorted(other, key=lambda r: r != 0)))
            if wrong is not None:
                assert not verdict(op, rank, wrong), (kind, rank, other)
                mixups += 1
        if rooted:
            swapped = simulate(op_of(kind, group, root=0), rank, (1, 0))  # root 1 instead of 0
            if swapped is not None:
                assert not verdict(op, rank, swapped)
                mixups += 1
    assert mixups >= 2  # the test did try wrong groups


def test_results_of_another_op_fail_through_the_salt():
    a = op_of("all_reduce", (0, 1), name="fwd/L0/ar1")
    b = next(op_of("all_reduce", (0, 1), name=f"fwd/L{i}/ar1") for i in range(1, 20)
             if sent_value(op_of("all_reduce", (0, 1), name=f"fwd/L{i}/ar1"), 0)
             != sent_value(a, 0))
    assert not verdict(a, 0, expected(b, 0, PER))


def test_p2p_message_from_the_wrong_peer_fails():
    recv = Op(name="fwd/mb0/recv", kind="recv", stream="p2p", peer=2, tag="act.c0.mb0", bytes=4)
    assert verdict(recv, 3, full(sent_value(recv, 2)))
    assert not verdict(recv, 3, full(sent_value(recv, 1)))


def test_busbw_factors_follow_nccl_tests():
    assert busbw_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    for k in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        assert busbw_factor(k, 4) == pytest.approx(3 / 4)
    for k in ("broadcast", "reduce", "sendrecv"):
        assert busbw_factor(k, 4) == 1.0
    with pytest.raises(ValueError):
        busbw_factor("barrier", 2)


def test_tags_are_stable_integers():
    assert p2p_tag("act.c0.mb1") == p2p_tag("act.c0.mb1") != p2p_tag("act.c0.mb2")
    assert 0 <= p2p_tag("grad.c1.mb7") < 2**30


def test_buffer_pool_reuses_given_back_tensors():
    pool = BufferPool(torch.device("cpu"))
    a = pool.take(10, torch.float32)
    pool.give(a)
    assert pool.take(10, torch.float32) is a and pool.held_bytes == 40
    assert pool.take(10, torch.float32) is not a and pool.held_bytes == 80
