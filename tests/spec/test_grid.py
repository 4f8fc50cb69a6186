"""RankGrid invariants: a bijection, groups that partition the world, rank order honoured."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from twin.spec import RankGrid
from twin.spec.grid import DIMS

sizes = st.sampled_from([1, 2, 3, 4])
orders = st.permutations(DIMS)


@given(dp=sizes, tp=sizes, pp=sizes, cp=st.just(1), order=orders)
def test_coords_and_rank_are_inverse(dp, tp, pp, cp, order):
    g = RankGrid.build(dp=dp, tp=tp, pp=pp, cp=cp, order=order, gpus_per_node=4)
    seen = set()
    for r in range(g.world_size):
        c = g.coords(r)
        assert g.rank(**c) == r
        seen.add(tuple(sorted(c.items())))
    assert len(seen) == g.world_size == dp * tp * pp * cp


@given(dp=sizes, tp=sizes, pp=sizes, order=orders,
       dims=st.sampled_from(["dp", "tp", "pp", "dp-pp", "tp-pp", "dp-tp-pp"]))
def test_groups_partition_the_world_and_fix_other_axes(dp, tp, pp, order, dims):
    g = RankGrid.build(dp=dp, tp=tp, pp=pp, order=order)
    groups = g.groups(dims)
    members = sorted(itertools.chain.from_iterable(groups))
    assert members == list(range(g.world_size))
    axes = dims.split("-")
    expected = 1
    for d in axes:
        expected *= g.size(d)
    for grp in groups:
        assert len(grp) == expected
        others = [{d: v for d, v in g.coords(r).items() if d not in axes} for r in grp]
        assert all(o == others[0] for o in others)
        for i, r in enumerate(grp):
            assert g.group(r, dims) == grp
            assert g.group_rank(r, dims) == i


def test_rank_order_innermost_axis_is_contiguous():
    # Megatron/Llama 3 order: tp innermost, so a TP group is 8 consecutive ranks on one node.
    g = RankGrid.build(dp=4, tp=8, pp=2, order=("tp", "cp", "pp", "dp"), gpus_per_node=8)
    assert g.group(0, "tp") == tuple(range(8))
    assert g.group(0, "pp") == (0, 8)
    assert g.group(0, "dp") == (0, 16, 32, 48)
    assert g.nodes_spanned(g.group(0, "tp")) == 1
    assert g.nodes_spanned(g.group(0, "dp")) == 4
    # dp innermost instead: DP replicas become neighbours.
    h = RankGrid.build(dp=4, tp=8, pp=2, order=("dp", "tp", "cp", "pp"), gpus_per_node=8)
    assert h.group(0, "dp") == (0, 1, 2, 3)
    assert h.group(0, "tp") == tuple(range(0, 32, 4))
    assert h.coords(5) == {"dp": 1, "tp": 1, "cp": 0, "pp": 0}


def test_nodes_and_local_ranks():
    g = RankGrid.build(dp=2, tp=8, pp=1, gpus_per_node=8)
    assert [g.node(r) for r in (0, 7, 8, 15)] == [0, 0, 1, 1]
    assert g.local_rank(13) == 5
    assert g.same_node(1, 6) and not g.same_node(7, 8)
    assert g.num_nodes == 2


def test_out_of_range_and_unknown_axes_are_clear():
    g = RankGrid.build(dp=2, tp=2, pp=1)
    with pytest.raises(ValueError, match="rank 4 out of range 0..3"):
        g.coords(4)
    with pytest.raises(ValueError, match="unknown axis 'ep'"):
        g.group(0, "ep")
    with pytest.raises(ValueError, match="tp=2 out of range 0..1"):
        g.rank(tp=2)


def test_large_grid_is_cheap_per_rank():
    # 16,384 GPUs: a rank's groups come from arithmetic, not from enumerating the world.
    g = RankGrid.build(dp=128, tp=8, pp=16, gpus_per_node=8)
    r = 12_345
    c = g.coords(r)
    assert g.rank(**c) == r
    assert len(g.group(r, "dp")) == 128 and r in g.group(r, "dp")
    assert g.group(r, "tp") == tuple(range(r - r % 8, r - r % 8 + 8))
