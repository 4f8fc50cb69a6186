"""RankGrid: the one map from global ranks to (dp, pp, cp, tp) coordinates, groups and nodes.

Built like picotron's grid (reshape ``arange(world)`` and slice an axis) but
arithmetically, so that a rank's groups at 16,384 GPUs cost O(group size):
with axes ordered innermost first, rank = sum(coord[d] * stride[d]) where
stride[d] is the product of the sizes of the axes inside d.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

DIMS = ("tp", "cp", "pp", "dp")
HSDP_DIMS = ("dp_shard", "dp_replicate")
"""The two parts of the dp axis under HSDP: dp_shard its inner dp_shard coordinates (a shard
group), dp_replicate the ranks at the same place in every shard group (torchtitan's mesh
("dp_replicate", "dp_shard", "cp", "tp"), outermost first)."""


@dataclass(frozen=True)
class RankGrid:
    """Global ranks laid out over named axes; consecutive ranks share a node."""

    order: tuple[str, ...]
    """Axis names, innermost first (e.g. ('tp', 'cp', 'pp', 'dp'))."""
    sizes: tuple[int, ...]
    """Axis sizes, in the same order."""
    gpus_per_node: int
    """Ranks per node: rank r lives on node r // gpus_per_node."""
    dp_shard: int | None = None
    """HSDP: the size of a shard group (it divides dp); None: the whole dp axis."""

    @classmethod
    def build(cls, *, dp: int, tp: int, pp: int, cp: int = 1,
              order: Sequence[str] = DIMS, gpus_per_node: int = 8,
              dp_shard: int | None = None) -> RankGrid:
        """A grid with the given degrees, axes in ``order`` (innermost first)."""
        size = {"dp": dp, "tp": tp, "pp": pp, "cp": cp}
        order = tuple(order)
        if sorted(order) != sorted(DIMS):
            raise ValueError(f"rank order {order} must name each of {DIMS} once")
        if dp_shard is not None and (dp_shard < 1 or dp % dp_shard):
            raise ValueError(f"dp_shard={dp_shard} must divide dp={dp}")
        return cls(order=order, sizes=tuple(size[d] for d in order), gpus_per_node=gpus_per_node,
                   dp_shard=dp_shard)

    @cached_property
    def _size(self) -> dict[str, int]:
        return dict(zip(self.order, self.sizes))

    @cached_property
    def _stride(self) -> dict[str, int]:
        stride, acc = {}, 1
        for dim, size in zip(self.order, self.sizes):
            stride[dim] = acc
            acc *= size
        return stride

    @cached_property
    def world_size(self) -> int:
        """Product of the axis sizes."""
        n = 1
        for s in self.sizes:
            n *= s
        return n

    def size(self, dim: str) -> int:
        """Degree of one axis."""
        return self._size[dim]

    def coords(self, rank: int) -> dict[str, int]:
        """{'dp': i, 'pp': j, 'cp': k, 'tp': l} of a global rank."""
        self._check(rank)
        return {d: (rank // self._stride[d]) % self._size[d] for d in self.order}

    def coord(self, rank: int, dim: str) -> int:
        """One coordinate of a global rank."""
        self._check(rank)
        return (rank // self._stride[dim]) % self._size[dim]

    def rank(self, **coords: int) -> int:
        """Global rank at the given coordinates (missing axes: 0)."""
        r = 0
        for dim, value in coords.items():
            if dim not in self._size:
                raise ValueError(f"unknown axis {dim!r}; axes are {self.order}")
            if not 0 <= value < self._size[dim]:
                raise ValueError(f"{dim}={value} out of range 0..{self._size[dim] - 1}")
            r += value * self._stride[dim]
        return r

    def group(self, rank: int, dims: str | Iterable[str]) -> tuple[int, ...]:
        """Ranks that share every coordinate of ``rank`` except those on ``dims``.

        ``dims`` is one axis ('dp') or several ('dp-pp' or ('dp', 'pp')); members
        are listed with the innermost of ``dims`` varying fastest, so the index of a
        rank in its group is its group rank.
        """
        dims = _dims(dims)
        hsdp = [d for d in dims if d in HSDP_DIMS]
        if hsdp:  # the group over dp, less the members in other parts of the dp axis
            dims = tuple(dict.fromkeys("dp" if d in HSDP_DIMS else d for d in dims))
            mine = self._dp_part(rank, hsdp)
        base = rank - sum(self.coord(rank, d) * self._stride[d] for d in dims)
        members = [base]
        for d in sorted(dims, key=self.order.index):
            stride = self._stride[d]
            members = [m + i * stride for i in range(self._size[d]) for m in members]
        if hsdp:
            members = [m for m in members if self._dp_part(m, hsdp) == mine]
        return tuple(members)

    def _dp_part(self, rank: int, hsdp: list[str]) -> int:
        """What the members of ``rank``'s dp_shard (or dp_replicate) group share: the shard
        group's index (or the place within a shard group)."""
        if len(hsdp) > 1:
            raise ValueError("a group over both dp_shard and dp_replicate is the dp group: use 'dp'")
        shard = self.dp_shard or self._size["dp"]
        d = self.coord(rank, "dp")
        return d // shard if hsdp[0] == "dp_shard" else d % shard

    def mover(self, source: int, target: int):
        """The map that moves any rank by ``target``'s offset from ``source`` on the grid:
        each coordinate shifted modulo its axis (under HSDP the dp axis's shard-group index
        and place within it each modulo their own size, so groups map onto groups)."""
        s, t = self.coords(source), self.coords(target)
        shard = self.dp_shard or self._size["dp"]
        sr, ss = divmod(s["dp"], shard)
        tr, ts = divmod(t["dp"], shard)
        reps = self._size["dp"] // shard
        delta = {d: t[d] - s[d] for d in self.order if d != "dp"}

        def move(m: int) -> int:
            c = self.coords(m)
            rep, sh = divmod(c["dp"], shard)
            out = {d: (c[d] + delta[d]) % self._size[d] for d in delta}
            out["dp"] = ((rep + tr - sr) % reps) * shard + (sh + ts - ss) % shard
            return self.rank(**out)

        return move

    def group_rank(self, rank: int, dims: str | Iterable[str]) -> int:
        """Index of ``rank`` within its group over ``dims``."""
        if any(d in HSDP_DIMS for d in _dims(dims)):
            return self.group(rank, dims).index(rank)
        idx, mult = 0, 1
        for d in sorted(_dims(dims), key=self.order.index):
            idx += self.coord(rank, d) * mult
            mult *= self._size[d]
        return idx

    def groups(self, dims: str | Iterable[str]) -> list[tuple[int, ...]]:
        """Every group over ``dims``, each once, ordered by its lowest rank."""
        dims = _dims(dims)
        seen, out = set(), []
        axes = {"dp" if d in HSDP_DIMS else d for d in dims}
        for r in range(self.world_size):
            if any(self.coord(r, d) for d in axes) and not set(dims) & set(HSDP_DIMS):
                continue
            if r not in seen:
                g = self.group(r, dims)
                seen.update(g)
                out.append(g)
        return out

    def node(self, rank: int) -> int:
        """Node index of a global rank."""
        self._check(rank)
        return rank // self.gpus_per_node

    def local_rank(self, rank: int) -> int:
        """Index of a rank within its node."""
        return rank % self.gpus_per_node

    def same_node(self, a: int, b: int) -> bool:
        """Whether two ranks share a node (and its NVLink/loopback fabric)."""
        return self.node(a) == self.node(b)

    def nodes_spanned(self, ranks: Iterable[int]) -> int:
        """How many nodes a group touches (1: intra-node only)."""
        return len({self.node(r) for r in ranks})

    @property
    def num_nodes(self) -> int:
        """Nodes the grid covers."""
        return -(-self.world_size // self.gpus_per_node)

    def _check(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range 0..{self.world_size - 1}")


def _dims(dims: str | Iterable[str]) -> tuple[str, ...]:
    out = tuple(dims.split("-")) if isinstance(dims, str) else tuple(dims)
    for d in out:
        if d not in DIMS and d not in HSDP_DIMS:
            raise ValueError(f"unknown axis {d!r}; axes are {DIMS} (and {HSDP_DIMS} under HSDP)")
    return out
