"""Context parallelism's checks against the model: what cp, cp_method and cp_load_balance need."""

from __future__ import annotations

from twin.spec.model import ModelSpec, _divisors
from twin.spec.parallel import ParallelPlan


def context_problems(model: ModelSpec, p: ParallelPlan) -> list[str]:
    """Every problem of a CP plan (cp > 1), each naming the field, the value and the fix.

    Each rank holds s/cp tokens of every sequence, in two chunks of s/(2cp) under headtail
    (torch's round-robin load balancer shards the sequence in 2cp chunks); Ulysses
    (alltoall) gives each rank heads/(tp*cp) query heads over the whole sequence, so the
    heads must split, and the KV heads must split or replicate evenly (as TP's GQA does)."""
    if p.cp == 1:
        return []
    problems: list[str] = []
    s = model.seq_len
    chunks = 2 * p.cp if p.cp_load_balance == "headtail" else p.cp
    if s % chunks:
        ok = [c for c in _divisors(s) if s % (2 * c if p.cp_load_balance == "headtail" else c) == 0]
        what = f"2 * cp = {chunks}" if p.cp_load_balance == "headtail" else f"cp={p.cp}"
        problems.append(f"{what} does not divide model.seq_len={s} (parallel.cp_load_balance="
                        f"{p.cp_load_balance} splits each sequence in {chunks} chunks); use cp in "
                        f"{', '.join(map(str, ok[:12]))}")
    if p.cp_method == "alltoall":
        heads, kv = model.num_heads, model.num_kv_heads
        if heads % (p.tp * p.cp):
            ok = [c for c in _divisors(heads) if heads % (p.tp * c) == 0]
            problems.append(f"parallel.cp_method=alltoall splits the heads over tp * cp = {p.tp} * "
                            f"{p.cp} = {p.tp * p.cp} but model.num_heads={heads}; use cp in "
                            f"{', '.join(map(str, ok))} or cp_method=ring")
        kv_tp = kv // p.tp if kv >= p.tp else 1
        if kv_tp % p.cp and p.cp % kv_tp:
            problems.append(f"parallel.cp_method=alltoall with {kv_tp} KV heads per TP rank "
                            f"(model.num_kv_heads={kv}, tp={p.tp}) and cp={p.cp}: one must divide "
                            "the other so KV heads split or replicate evenly; change cp or use "
                            "cp_method=ring")
    if not p.flash_attention:
        problems.append(f"parallel.cp={p.cp} needs parallel.flash_attention=true (CP attention "
                        "merges partial results by their log-sum-exp, as torch's context_parallel "
                        "runs only the fused SDPA kernels); set it or parallel.cp=1")
    if model.moe is not None:
        problems.append(f"parallel.cp={p.cp} with a mixture-of-experts model ({model.name}) is not "
                        "modelled; set parallel.cp=1")
    return problems
