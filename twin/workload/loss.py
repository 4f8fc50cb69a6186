"""The loss's memory at the peak: what the cross-entropy over the vocabulary keeps for its
backward and what it makes in passing, eager (torchtitan's ``F.cross_entropy(logits.float())``),
vocabulary-parallel (``loss_parallel`` under TP) or compiled (``parallel.compile_loss``)."""

from __future__ import annotations

from twin.spec import ModelSpec, ParallelPlan
from twin.workload.params import vocab_rows


def compiled_loss(par: ParallelPlan) -> bool:
    """Whether torch.compile fuses the loss (parallel.compile and compile_loss) with the
    vocabulary whole on the rank (under loss_parallel, tp > 1, its eager forms stay)."""
    return par.compile and par.compile_loss and par.tp == 1


def saved_logits_bytes(model: ModelSpec, par: ParallelPlan, batch: int) -> float:
    """What the loss keeps for its backward (Korthikanti §4.3: the fp32 log-softmax, 4N for
    N = s b V/t logits); compiled, the e-byte logits and an fp32 log-sum-exp per token."""
    s = model.seq_len
    if compiled_loss(par):
        return model.dtype_bytes * s * batch * model.vocab_size + 4 * s * batch
    return 4 * s * batch * vocab_rows(model, par.tp)


def loss_temporary_bytes(model: ModelSpec, batch: int, tp: int = 1,
                         compiled: bool = False) -> float:
    """Cross-entropy over the vocabulary in fp32, beyond the saved log-softmax (4N bytes,
    counted in activations); N = s b V/t logits on the rank, e the model's dtype bytes.

    Eager ``F.cross_entropy(logits.float())`` (t = 1): forward holds the logits, their fp32
    copy and the log-softmax, (e + 8)N; backward the saved log-softmax, nll_loss's gradient
    and log_softmax's, 12N. Vocab-parallel (t > 1, torch.distributed.tensor.parallel
    loss_parallel, _log_softmax and _nll_loss_and_log_softmax_backward): forward the logits,
    x, x - max and exp(x - max), (e + 12)N; backward the saved log-softmax, the one-hot
    gradient, it plus exp(x) and the product, 16N. ``compiled`` (torch.compile of the loss,
    t = 1: parallel.compile_loss): the fused backward makes the logits' gradient alone, eN.
    """
    n = model.seq_len * batch * vocab_rows(model, tp)
    e = model.dtype_bytes
    if compiled and tp == 1:
        return e * n
    peak = max(e + 8, 12) if tp == 1 else max(e + 12, 16)
    return (peak - 4) * n
