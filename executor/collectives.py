"""Collectives and p2p of the IR on real buffers, and the values that prove they ran on the right group.

Sizes follow nccl-tests (twin.schedule.ir): all_reduce, broadcast and reduce move a
buffer of ``bytes``; all_gather's ``bytes`` is the gathered output (each rank gives
bytes/n); reduce_scatter's is the full input (each rank keeps bytes/n); all_to_all's is
the send buffer (bytes/n to each peer); gather's and scatter's the full buffer at the
root. Per-rank pieces round up to whole elements.

Verification (``verify=True``): buffers are fp64 and rank r fills chunk c of its input
with s * (2**r + c * 2**24), s a salt from the op's name (the same on every member). A sum
over a group is then s * (the bit mask of its members + chunk terms), and a gathered or
exchanged chunk names its sender and chunk: a result from the wrong group, the wrong
root, the wrong chunk or the wrong op cannot match. Exact in fp64 for worlds up to 24.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from executor.kernels import torch_dtype
from twin.schedule.ir import Op

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Backend

MAX_VERIFY_WORLD = 24
CHUNK_SHIFT = 2.0 ** 24
_TAG_MASK = 0x3FFFFFFF


def p2p_tag(tag: str) -> int:
    """A stable integer for a send/recv tag string (CRC32; the same in every process)."""
    return zlib.crc32(tag.encode()) & _TAG_MASK


def salt(name: str) -> float:
    """A small factor (1..5) from an op's name, the same on every member of its group."""
    return float(zlib.crc32(name.encode()) % 5 + 1)


class BufferPool:
    """Reusable tensors by (numel, dtype): taken at issue, given back at completion."""

    def __init__(self, device: torch.device):
        self.device = device
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self.held_bytes = 0

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        free = self._free.get((numel, dtype))
        if free:
            return free.pop()
        self.held_bytes += numel * dtype.itemsize
        return torch.zeros(numel, dtype=dtype, device=self.device)

    def give(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            self._free.setdefault((t.numel(), t.dtype), []).append(t)


@dataclass
class Issued:
    """An issued collective or p2p: its work handle, its buffers, and the tensor it fills."""

    work: dist.Work
    buffers: tuple[torch.Tensor, ...]
    result: torch.Tensor | _Cat | None
    """What the op produces on this rank (None: nothing, e.g. a send or a non-root reduce;
    a gather's root: its pieces, read as one tensor when checked)."""


def _numel(nbytes: float, itemsize: int, parts: int = 1) -> int:
    """Elements per part for ``nbytes`` split in ``parts`` (at least one element)."""
    return max(1, -(-int(round(nbytes)) // (itemsize * parts)))


def _full(per: int, value: float) -> torch.Tensor:
    return torch.full((per,), value, dtype=torch.float64)


def _chunks(values: list[float], per: int) -> torch.Tensor:
    return torch.cat([_full(per, v) for v in values])


def sent_value(op: Op, rank: int, chunk: int = 0) -> float:
    """The verification value ``rank`` puts in chunk ``chunk`` of its input of ``op``."""
    s = salt(op.tag if op.is_p2p else op.name)
    return s * (2.0 ** rank + chunk * CHUNK_SHIFT)


def expected(op: Op, rank: int, per: int) -> torch.Tensor | None:
    """What ``op`` must leave in ``rank``'s result when every member filled its input with
    ``sent_value`` (``per``: elements per chunk); None where the rank gets nothing."""
    if op.kind == "send":
        return None
    if op.kind == "recv":
        return _full(per, sent_value(op, op.peer))
    group = op.group
    g = group.index(rank)
    root = group.index(op.root) if op.root >= 0 else 0
    if op.kind == "all_reduce":
        return _full(per, sum(sent_value(op, m) for m in group))
    if op.kind == "broadcast":
        return _full(per, sent_value(op, group[root]))
    if op.kind == "reduce":
        return _full(per, sum(sent_value(op, m) for m in group)) if g == root else None
    if op.kind in ("all_gather", "gather"):
        if op.kind == "gather" and g != root:
            return None
        return _chunks([sent_value(op, m) for m in group], per)
    if op.kind == "reduce_scatter":
        return _full(per, sum(sent_value(op, m, g) for m in group))
    if op.kind == "all_to_all" and op.recv_splits:  # uneven: chunk j is member j's to us
        sizes = split_numels(op.recv_splits, torch.float64.itemsize)
        return torch.cat([_full(c, sent_value(op, m, g)) for m, c in zip(group, sizes)])
    if op.kind == "all_to_all":
        return _chunks([sent_value(op, m, g) for m in group], per)
    if op.kind == "scatter":
        return _full(per, sent_value(op, group[root], g))
    raise ValueError(f"{op.name}: {op.kind} is not a collective or p2p op")


def check(op: Op, rank: int, issued: Issued) -> None:
    """Raise AssertionError naming the op and group when a verified result is wrong."""
    if issued.result is None:
        return
    n = 1 if op.is_p2p or op.kind in ("all_reduce", "broadcast", "reduce", "reduce_scatter",
                                      "scatter") else len(op.group)
    got = issued.result.double().cpu()
    want = expected(op, rank, got.numel() // n)
    if want is None:
        return
    if not torch.equal(want, got):
        bad = int((want != got).nonzero()[0].item())
        raise AssertionError(
            f"rank {rank}: {op.kind} {op.name!r} on group {op.group or (rank, op.peer)} gave "
            f"element {bad} = {got[bad].item():g}, expected {want[bad].item():g} "
            "(the op ran on the wrong group, root, peer or buffer)")


def split_numels(splits: tuple[float, ...], itemsize: int) -> list[int]:
    """Elements per peer of an uneven all-to-all's byte splits (rounded up; 0 stays 0)."""
    return [-(-int(round(b)) // itemsize) for b in splits]


def _uneven_all_to_all(pg: Backend, op: Op, rank: int, pool: BufferPool, dtype: torch.dtype,
                       verify: bool) -> Issued:
    """``all_to_all_single`` with input and output split sizes (MoE token dispatch): chunk
    j of the input goes to member j, chunk j of the output comes from member j."""
    send = split_numels(op.send_splits, dtype.itemsize)
    recv = split_numels(op.recv_splits, dtype.itemsize)
    inp, out = pool.take(sum(send), dtype), pool.take(sum(recv), dtype)
    if verify:
        for j, part in enumerate(torch.split(inp, send)):
            part.fill_(sent_value(op, rank, j))
        out.fill_(-1.0)
    return Issued(pg.alltoall_base(out, inp, recv, send), (inp, out), out)


def _fill(buf: torch.Tensor, op: Op, rank: int, chunks: int = 1) -> None:
    for c, part in enumerate(buf.view(chunks, -1)):
        part.fill_(sent_value(op, rank, c))


def issue(pg: Backend, op: Op, rank: int, pool: BufferPool, verify: bool = False,
          pair: bool = True) -> Issued:
    """Start ``op`` asynchronously on backend ``pg`` (a gloo or NCCL ``Backend``).

    ``pg`` spans ``op.group`` for collectives (group ranks are indices into op.group); for
    send/recv it spans the two ranks in rank order (``pair``, groups.py) or, with
    ``pair=False``, every rank (the peer is then a global rank). With ``verify`` the
    inputs hold ``sent_value`` and the outputs -1 until the op writes them.
    """
    dtype = torch.float64 if verify else torch_dtype(op.dtype)
    e = dtype.itemsize
    if op.is_p2p:
        buf = pool.take(_numel(op.bytes, e), dtype)
        if verify:
            buf.fill_(sent_value(op, rank) if op.kind == "send" else -1.0)
        peer = sorted((rank, op.peer)).index(op.peer) if pair else op.peer
        if op.kind == "send":
            return Issued(pg.send([buf], peer, p2p_tag(op.tag)), (buf,), None)
        return Issued(pg.recv([buf], peer, p2p_tag(op.tag)), (buf,), buf)
    group, kind = op.group, op.kind
    n, g = len(group), group.index(rank)
    root = group.index(op.root) if op.root >= 0 else 0
    if kind in ("all_reduce", "broadcast", "reduce"):
        buf = pool.take(_numel(op.bytes, e), dtype)
        if verify:
            buf.fill_(-1.0 if kind == "broadcast" and g != root else sent_value(op, rank))
        if kind == "all_reduce":
            return Issued(pg.allreduce([buf]), (buf,), buf)
        opts = dist.BroadcastOptions() if kind == "broadcast" else dist.ReduceOptions()
        opts.rootRank = root
        work = pg.broadcast([buf], opts) if kind == "broadcast" else pg.reduce([buf], opts)
        return Issued(work, (buf,), buf if kind == "broadcast" or g == root else None)
    if kind == "all_to_all" and op.send_splits:
        return _uneven_all_to_all(pg, op, rank, pool, dtype, verify)
    per = _numel(op.bytes, e, n)
    if kind == "all_gather":
        inp, out = pool.take(per, dtype), pool.take(per * n, dtype)
        if verify:
            _fill(inp, op, rank)
            out.fill_(-1.0)
        return Issued(pg._allgather_base(out, inp), (inp, out), out)
    if kind == "gather":
        inp = pool.take(per, dtype)
        outs = [pool.take(per, dtype) for _ in range(n)] if g == root else []
        if verify:
            _fill(inp, op, rank)
            for t in outs:
                t.fill_(-1.0)
        opts = dist.GatherOptions()
        opts.rootRank = root
        work = pg.gather([outs] if outs else [], [inp], opts)
        return Issued(work, (inp, *outs), _Cat(outs) if outs else None)
    if kind in ("reduce_scatter", "all_to_all"):
        inp = pool.take(per * n, dtype)
        out = pool.take(per if kind == "reduce_scatter" else per * n, dtype)
        if verify:
            _fill(inp, op, rank, n)
            out.fill_(-1.0)
        work = pg._reduce_scatter_base(out, inp) if kind == "reduce_scatter" \
            else pg.alltoall_base(out, inp, [], [])
        return Issued(work, (inp, out), out)
    if kind == "scatter":
        out = pool.take(per, dtype)
        ins = [pool.take(per, dtype) for _ in range(n)] if g == root else []
        if verify:
            out.fill_(-1.0)
            for c, t in enumerate(ins):
                t.fill_(sent_value(op, rank, c))
        opts = dist.ScatterOptions()
        opts.rootRank = root
        return Issued(pg.scatter([out], [ins] if ins else [], opts), (out, *ins), out)
    raise ValueError(f"{op.name}: {kind} is not a collective or p2p op")


class _Cat:
    """The gathered pieces read as one tensor when checked (after the op completes)."""

    def __init__(self, parts: list[torch.Tensor]):
        self.parts = parts

    def double(self) -> torch.Tensor:
        return torch.cat(self.parts).double()
