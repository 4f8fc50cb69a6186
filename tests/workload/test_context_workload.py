"""Context parallelism's closed forms: blocks, shares of the causal work, traffic, buffers."""

from __future__ import annotations

import pytest

from tests.conftest import gpt
from twin.spec import ParallelPlan
from twin.workload.context import (
    DKV_BYTES,
    Block,
    allgather_blocks,
    attention_share,
    buffer_bytes,
    layer_traffic,
    rank_blocks,
    ring_blocks,
)

S = 4096


def plan(cp, method="ring", balance="headtail", **kw):
    return ParallelPlan(cp=cp, cp_method=method, cp_load_balance=balance, dp=1, **kw)


@pytest.mark.parametrize("method", ["ring", "allgather"])
@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_headtail_gives_every_rank_an_equal_share(method, cp):
    """Rank i holds chunks i and 2cp-1-i: each rank does 1/cp of the causal s^2/2 work."""
    shares = [attention_share(plan(cp, method), S * cp, i) for i in range(cp)]
    assert shares == pytest.approx([1 / cp] * cp)


@pytest.mark.parametrize("method", ["ring", "allgather"])
@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_no_balance_gives_rank_i_the_share_2i_plus_1_over_cp_squared(method, cp):
    """Contiguous chunks: rank i attends to chunks 0..i, i full blocks and half a diagonal;
    the last rank does (2cp-1)/cp of the average, about twice."""
    shares = [attention_share(plan(cp, method, "none"), S * cp, i) for i in range(cp)]
    assert shares == pytest.approx([(2 * i + 1) / cp ** 2 for i in range(cp)])
    assert sum(shares) == pytest.approx(1.0)
    assert shares[-1] * cp == pytest.approx(2 - 1 / cp)


def test_ring_blocks_follow_torchs_round_robin_branches():
    """torch's _templated_ring_attention with load balancing: step 0 the local causal block;
    then all queries against half the KV chunk of an earlier rank (i <= rank), else half the
    queries against a later rank's whole chunk. Without balancing a later rank's chunk is
    skipped."""
    c = 1024
    assert ring_blocks(4, 1, c, "headtail") == [Block(c, c, True), Block(c, c // 2, False),
                                                 Block(c // 2, c, False), Block(c // 2, c, False)]
    assert ring_blocks(4, 1, c, "none") == [Block(c, c, True), Block(c, c, False), None, None]
    assert allgather_blocks(4, 3, c, "none") == [Block(c, c, True), Block(c, 3 * c, False)]
    assert allgather_blocks(4, 0, c, "none") == [Block(c, c, True)]


def test_ulysses_does_the_whole_square_on_a_cp_th_of_the_heads():
    p = plan(4, "alltoall")
    assert rank_blocks(p, S, 2) == [Block(S, S, True)]
    assert attention_share(p, S, 2) == pytest.approx(1 / 4)


def test_layer_traffic_figures():
    """Llama-3 8B-like attention (32 heads, 8 KV heads of 128, b=1, s=8192, bf16) at cp=4:
    a KV chunk is 2 * 2048 * 1024 * 2 B = 8 MiB."""
    m = gpt(hidden_size=4096, num_heads=32, num_kv_heads=8, seq_len=8192, ffn_hidden_size=4096)
    mib = 2 ** 20
    fwd, bwd = layer_traffic(m, plan(4, "ring"))
    assert fwd == [("send", 3, 8 * mib)]
    assert bwd == [("send", 3, 8 * mib), ("send", 4, 16 * mib)]  # dK/dV in fp32
    fwd, bwd = layer_traffic(m, plan(4, "allgather"))
    assert fwd == [("all_gather", 1, 32 * mib)]
    assert bwd == [("all_gather", 1, 32 * mib), ("reduce_scatter", 1, 64 * mib)]
    fwd, bwd = layer_traffic(m, plan(4, "alltoall"))
    q = 2048 * 32 * 128 * 2  # b * s/cp * q_dim * e: 16 MiB
    kv = 2048 * 8 * 128 * 2  # 4 MiB each for k and v
    assert fwd == bwd == [("all_to_all", 2, q), ("all_to_all", 2, kv)]
    assert q == 16 * mib


def test_ulysses_replicates_kv_heads_up_to_cp():
    """2 KV heads per rank at cp=4: each is sent as 4 (one per CP rank), as TP replicates."""
    m = gpt(hidden_size=512, num_heads=8, num_kv_heads=2, seq_len=256, ffn_hidden_size=512)
    fwd, _ = layer_traffic(m, plan(4, "alltoall"))
    assert fwd[1] == ("all_to_all", 2, 1 * 64 * 4 * 64 * 2)


def test_kv_buffers():
    """ring: two KV chunks (in use, in flight) and two fp32 dK/dV chunks; allgather: the
    gathered K and V plus their unreduced fp32 gradients; Ulysses and cp=1: none."""
    m = gpt(hidden_size=4096, num_heads=32, num_kv_heads=8, seq_len=8192, ffn_hidden_size=4096)
    chunk = 2 * 2048 * 1024  # K and V elements of s/cp tokens
    assert buffer_bytes(m, plan(4, "ring")) == 2 * chunk * (2 + DKV_BYTES)
    assert buffer_bytes(m, plan(4, "allgather")) == 4 * chunk * (2 + DKV_BYTES)
    assert buffer_bytes(m, plan(4, "alltoall")) == 0
    assert buffer_bytes(m, plan(1)) == 0
