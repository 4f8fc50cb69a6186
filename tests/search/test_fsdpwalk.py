"""FSDP's chunk walk (twin.search.fsdpwalk.chunk_s) against its closed forms."""

from __future__ import annotations

import pytest

from twin.search.fsdpwalk import chunk_s, tail_s


@pytest.mark.parametrize("n", [1, 3, 12])
def test_forward_is_bound_by_the_network_or_by_compute(n):
    """Gathers one layer ahead: the first gather exposed, then the longer of the two."""
    c, g = 2.0, 5.0  # network-bound: the gathers back to back, the last layer after them
    assert chunk_s(n, c, g) == pytest.approx(n * g + c)
    c, g = 5.0, 2.0  # compute-bound: only the first gather shows
    assert chunk_s(n, c, g) == pytest.approx(g + n * c)


@pytest.mark.parametrize("n", [1, 4, 12])
def test_backward_reduce_scatters_follow_each_layer(n):
    """Parameters kept (no gathers): a layer's reduce-scatter starts when its backward ends.
    A host that waits for them pays the last; otherwise the chunk takes at least the links'
    work (its transfers overlap the next chunk's compute, not its transfers)."""
    c, r = 2.0, 5.0  # network-bound
    assert chunk_s(n, c, 0.0, r, wait=True) == pytest.approx(c + n * r)
    assert chunk_s(n, c, 0.0, r) == pytest.approx(max(n * c, n * r))
    c, r = 5.0, 2.0  # compute-bound
    assert chunk_s(n, c, 0.0, r, wait=True) == pytest.approx(n * c + r)
    assert chunk_s(n, c, 0.0, r) == pytest.approx(n * c)


def test_gathers_and_reduce_scatters_share_the_links():
    """Resharded backward, network-bound: every layer's gather and reduce-scatter pass the
    same links, so the chunk takes at least their sum; more work never takes less time."""
    n, c, g, r = 6, 1.0, 3.0, 2.0
    t = chunk_s(n, c, g, r, wait=True)
    assert t >= n * (g + r)
    assert chunk_s(n, c, g, r) <= t
    assert chunk_s(n, c, g, r + 1.0, wait=True) > t
    assert chunk_s(0, c, g, r) == 0.0


def test_compute_slowed_beside_the_next_layers_gather():
    """Compute-bound with overlap_slowdown s: each layer but the last computes beside the
    next one's gather, paying s / (1 + s) of the gather's time: g + n c + (n - 1) g s/(1+s)."""
    n, c, g, s = 6, 4.0, 1.0, 0.5
    assert chunk_s(n, c, g, s=s) == pytest.approx(g + n * c + (n - 1) * g * s / (1 + s))
    assert chunk_s(n, c, g, s=0.0) == pytest.approx(chunk_s(n, c, g))
    # network-bound: the links' work, then the last layer, which computes alone
    assert chunk_s(n, 0.5, 2.0, s=s) == pytest.approx(n * 2.0 + 0.5)


def test_a_tail_beside_compute():
    c, last, s = 10.0, 1.0, 0.25
    assert tail_s(c, 4.0, last) == pytest.approx(last)  # hidden but the last bucket
    assert tail_s(c, 14.0, last) == pytest.approx(4.0)
    # beside it the compute slows by s times the overlapped share: 4 s / (1 + s) here
    assert tail_s(c, 4.0, last, s) == pytest.approx(4.0 * s / (1 + s) + last)
    assert tail_s(c, 20.0, last, s) == pytest.approx(20.0 - c)  # transfers still the longer
