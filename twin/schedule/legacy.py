"""Legacy data parallelism (nn.DataParallel): one process drives every device of a node.

Per micro-batch (PyTorch's DataParallel.forward, and mission seed 000): device 0
scatters the inputs, broadcasts the parameters (``replicate``) to every device, each
device runs forward, the outputs (logits) are gathered to device 0, which computes the
loss over all of them and scatters the output gradients back; each device runs
backward and the gradients are reduced to device 0 (the backward of ``Broadcast``).
Device 0 alone keeps the optimizer states and steps: it does more work and holds more
memory than the others.
"""

from __future__ import annotations

from twin.schedule.emit import Ctx, ProgramBuilder
from twin.schedule.ir import Program
from twin.schedule.recompute import head_activation_bytes, layer_activation_bytes
from twin.schedule.tensor import TensorParallel
from twin.spec import Job
from twin.workload.memory import model_state_bytes
from twin.workload.params import stage_params


def legacy_dp_program(job: Job, rank: int) -> Program:
    """The program of device ``rank`` under nn.DataParallel."""
    model, par, grid = job.model, job.parallel, job.grid
    b = ProgramBuilder(job, rank)
    tp = TensorParallel(b, model, par, grid.group(rank, "tp"))
    layer_acts = layer_activation_bytes(model, par, par.recompute)
    head_acts = head_activation_bytes(model, par, b.e)
    group = grid.group(rank, "dp")
    root = group[0]
    is_root = rank == root
    params = stage_params(job, 0)
    tokens = par.micro_batch_size * model.seq_len
    logits = 4 * tokens * model.vocab_size  # fp32 logits of one device
    states = model_state_bytes(params, 1, 0, model.dtype)
    setup = Ctx("setup")
    b.alloc(setup, "model.params", "params", states.params)
    b.alloc(setup, "model.grads", "grads", states.grads)
    if is_root:
        b.alloc(setup, "model.optimizer", "optimizer", states.optimizer)
    for mb in range(par.num_microbatches):
        ctx = Ctx("fwd", mb=mb, chunk=0, paradigm="legacy_dp")
        inp = b.collective(ctx, "inputs.scatter", "scatter", group, "dp",
                           8 * tokens * len(group), [b.last_compute], root=root)
        rep = b.collective(ctx, "params.bcast", "broadcast", group, "dp", params * b.e,
                           [b.last_compute], root=root)
        x = tp.embedding_forward(ctx, [inp, rep])
        for layer in range(model.num_layers):
            lctx = ctx.at(layer=layer)
            b.alloc(lctx, f"act.L{layer}.mb{mb}", "activations", layer_acts)
            x = tp.layer_forward(lctx, x)
        b.alloc(ctx, f"act.head.mb{mb}", "activations", head_acts)
        x = tp.head_forward(ctx, x, with_loss=False)
        if is_root:
            b.alloc(ctx, f"gathered.logits.mb{mb}", "buffers", logits * len(group))
        x = b.collective(ctx, "logits.gather", "gather", group, "dp", logits * len(group), [x],
                         root=root)
        if is_root:
            x = b.elementwise(ctx, "loss", logits * len(group) // 4, [x], tensors=2,
                              flops_per_element=5, reduction=True)
            x = b.elementwise(ctx.at(phase="bwd"), "loss.bwd", logits * len(group) // 4, [x],
                              tensors=2, flops_per_element=4, reduction=True)
        bctx = Ctx("bwd", mb=mb, chunk=0, paradigm="legacy_dp")
        g = b.collective(bctx, "logits.grad.scatter", "scatter", group, "dp",
                         logits * len(group), [x], root=root)
        if is_root:
            b.free(bctx, f"gathered.logits.mb{mb}", "buffers", logits * len(group), [g])
        grads: dict[str, int] = {}
        g = tp.head_backward(bctx, g, grads, with_loss=False)
        b.free(bctx, f"act.head.mb{mb}", "activations", head_acts, [g])
        waits = list(grads.values())
        for layer in reversed(range(model.num_layers)):
            lctx = bctx.at(layer=layer)
            grads = {}
            g = tp.layer_backward(lctx, g, grads)
            b.free(lctx, f"act.L{layer}.mb{mb}", "activations", layer_acts, [g])
            waits += grads.values()
        grads = {}
        g = tp.embedding_backward(bctx, g, grads)
        waits += grads.values()
        reduced = b.collective(bctx, "grads.reduce", "reduce", group, "dp", params * b.e, waits,
                               root=root)
    if is_root:
        b.optimizer(Ctx("opt", paradigm="legacy_dp"), "adam", params, [b.last_compute, reduced],
                    fused=job.parallel.optimizer_kernels == "fused")
    return b.program()
