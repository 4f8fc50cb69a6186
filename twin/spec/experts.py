"""ExpertGrid: the expert-parallel (EP), expert-tensor (ETP) and expert-data (EDP) groups.

Megatron-Core's convention ("MoE Parallel Folding", Liu et al. 2025, arXiv:2504.14960,
§3): attention runs on TP x CP x DP x PP, the experts on ETP x EP x EDP x PP, and within
each pipeline stage both grids fold the same ranks, ETP x EP x EDP = TP x CP x DP. The
stage's ranks are listed in the dense grid's order (innermost first: their index i is the
rank's group rank over tp, cp and dp) and re-read with etp innermost, as Megatron's
RankGenerator orders the expert ranks tp-ep-dp-pp:

    etp = i mod etp,   ep = (i div etp) mod ep,   edp = i div (etp * ep).

So ETP is not TP (etp=1 with tp=2 puts TP peers in one EP group), EP takes ranks from DP
(and from TP when etp < tp), and the expert gradients are reduced over EDP: the ranks
holding the same experts, edp = tp * cp * dp / (etp * ep), not over the dense DP group.
With ep = 1 and etp = tp the experts are sharded as the dense MLP, on the TP groups with
their gradients reduced over cp x dp, whatever the rank order (read as above, a rank order
with dp inside tp would give them groups of dp peers instead; has_expert_groups is false).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from twin.spec.grid import RankGrid
from twin.spec.model import ModelSpec, _divisors
from twin.spec.parallel import ParallelPlan

STAGE_DIMS = ("tp", "cp", "dp")
"""The dense axes the expert grid folds within a pipeline stage."""


@dataclass(frozen=True)
class ExpertGrid:
    """The expert groups of a rank grid (see the module docstring)."""

    grid: RankGrid
    ep: int
    etp: int

    @cached_property
    def edp(self) -> int:
        """Expert-data-parallel degree: tp * cp * dp / (etp * ep)."""
        return self.stage_size // (self.ep * self.etp)

    @cached_property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage: tp * cp * dp."""
        n = 1
        for d in STAGE_DIMS:
            n *= self.grid.size(d)
        return n

    @cached_property
    def dense(self) -> bool:
        """ep = 1 and etp = tp: the experts live on the dense groups (module docstring)."""
        return self.ep == 1 and self.etp == self.grid.size("tp")

    def coords(self, rank: int) -> dict[str, int]:
        """{'etp': ..., 'ep': ..., 'edp': ...} of a global rank."""
        if self.dense:
            return {"etp": self.grid.coord(rank, "tp"), "ep": 0,
                    "edp": self.grid.group_rank(rank, ("cp", "dp"))}
        i = self.grid.group_rank(rank, STAGE_DIMS)
        return {"etp": i % self.etp, "ep": i // self.etp % self.ep,
                "edp": i // (self.etp * self.ep)}

    def group(self, rank: int, dim: str) -> tuple[int, ...]:
        """The ranks sharing every expert coordinate of ``rank`` but ``dim`` (etp, ep or
        edp), in the order of ``dim``'s coordinate (its index is the group rank)."""
        if self.dense:
            return self.grid.group(rank, {"etp": "tp", "edp": ("cp", "dp")}[dim]) \
                if dim != "ep" else (rank,)
        stage = self.grid.group(rank, STAGE_DIMS)  # index = stage-local index
        c = self.coords(rank)
        stride = {"etp": 1, "ep": self.etp, "edp": self.etp * self.ep}
        size = {"etp": self.etp, "ep": self.ep, "edp": self.edp}
        base = sum(c[d] * stride[d] for d in stride if d != dim)
        return tuple(stage[base + j * stride[dim]] for j in range(size[dim]))


def expert_grid(grid: RankGrid, par: ParallelPlan) -> ExpertGrid:
    """The expert groups of ``grid`` under plan ``par`` (ep, etp resolved)."""
    return ExpertGrid(grid, par.ep, par.expert_tp)


def expert_problems(model: ModelSpec, p: ParallelPlan, dp: int | None) -> list[str]:
    """Every problem of the expert plan, each naming the field, the value and the fix."""
    problems: list[str] = []
    moe, etp = model.moe, p.expert_tp
    if moe is None:
        if p.ep > 1 or p.etp is not None:
            field = f"parallel.ep={p.ep}" if p.ep > 1 else f"parallel.etp={p.etp}"
            problems.append(f"{field} needs a mixture-of-experts model but model {model.name} "
                            "is dense (model.moe is null); set parallel.ep=1 parallel.etp=null "
                            "or use a MoE preset (mixtral_8x7b, deepseek_v3, qwen3_30b_a3b)")
        return problems
    if moe.num_experts % p.ep:
        problems.append(f"parallel.ep={p.ep} does not divide model.moe.num_experts="
                        f"{moe.num_experts}; use one of "
                        f"{', '.join(map(str, _divisors(moe.num_experts)))}")
    if moe.moe_ffn_hidden_size % etp:
        problems.append(f"etp={etp} does not divide model.moe.moe_ffn_hidden_size="
                        f"{moe.moe_ffn_hidden_size}; set parallel.etp to a divisor of it")
    if moe.shared_ffn_hidden_size % p.tp:
        problems.append(f"tp={p.tp} does not divide the shared experts' inner size "
                        f"{moe.shared_experts} x {moe.moe_ffn_hidden_size}; change parallel.tp")
    if dp is not None:
        stage = p.tp * p.cp * dp
        if stage % (p.ep * etp):
            ok = [e for e in _divisors(moe.num_experts) if stage % (e * etp) == 0]
            problems.append(f"ep * etp = {p.ep} * {etp} = {p.ep * etp} must divide the "
                            f"tp * cp * dp = {p.tp} * {p.cp} * {dp} = {stage} ranks of a "
                            f"pipeline stage that experts fold onto; use ep in "
                            f"{', '.join(map(str, ok)) or '1'} or change dp / tp / etp")
    if p.tp > 1 and not p.sp and (p.ep > 1 or etp != p.tp):
        problems.append(f"parallel.ep={p.ep}, etp={etp} with tp={p.tp} needs sequence "
                        "parallelism (Megatron asserts it: each TP rank routes its own tokens); "
                        "set parallel.sp=true")
    if p.zero_stage == 3 and (p.ep > 1 or etp != p.tp):
        problems.append(f"parallel.zero_stage=3 with ep={p.ep}, etp={etp}: sharding expert "
                        "parameters over their own expert-data-parallel group is not modelled; "
                        "use zero_stage 0, 1 or 2, or ep=1 with etp=tp (experts sharded as dense)")
    if getattr(p, "dp_replicate", 1) > 1 and p.ep > 1:
        problems.append(f"parallel.dp_replicate={p.dp_replicate} (HSDP) with ep={p.ep} is not "
                        "modelled; set parallel.dp_replicate=1 or parallel.ep=1")
    if p.legacy_dp:
        problems.append("parallel.legacy_dp=true cannot run a MoE model's experts; set "
                        "legacy_dp=false")
    return problems


def has_expert_groups(model: ModelSpec, par: ParallelPlan) -> bool:
    """Whether the experts run on groups of their own (ep > 1 or etp != tp): groups that a
    shift along one dense axis does not map onto groups, so every rank's program is built
    (not translated) and no axis is folded in the twin."""
    return model.moe is not None and (par.ep > 1 or par.expert_tp != par.tp)
