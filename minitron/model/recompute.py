"""Activation recomputation: keep less for backward, compute it again when backward needs it.

Korthikanti et al. (2022), "Reducing Activation Recomputation in Large Transformer Models":

  "full"       each Transformer layer keeps only its input; backward runs the layer's forward
               again (with grad enabled) and then its backward. Activation memory per layer
               falls from 34sbh + 5as^2b to 2sbh; the cost is one more forward per layer,
               about a third more compute (flops.py counts it).
  "selective"  only the attention core, softmax(QK^T/sqrt(d)) V with its dropout, is
               recomputed: it holds the 5as^2b term (scores, probabilities, their dropout
               mask), the largest per byte of compute, while it costs only the two s^2 matmuls.
  "none"       autograd keeps everything.

`checkpoint(fn, rng, *tensors)` is the one mechanism for both: fn runs under no_grad in the
forward, only `tensors` are saved (through save_for_backward, so saved-tensor hooks count
them: estimate/activations.py's "layer input" for full, "Q, K, V" for selective), and backward reruns
fn with grad enabled and backpropagates through the rerun. Parameters' gradients accumulate
during that inner backward, as in Megatron's reentrant CheckpointFunction.

Dropout masks. minitron's masks are keyed by (step seed, layer, call, row)
(tensor_parallel/random.py), so the recompute draws exactly the forward's masks when the
RNG's *site* (step seed, layer, call counter, first row) is put back to where it was; the
streamed generators of dropout_rng="per_rank" have their states saved too. This small state
is what is saved, not torch's global RNG state. The recompute runs between other work (a
pipeline rank's next forward, say), so the site is restored afterwards as well: the rerun
leaves no trace on the RNG.

Collectives inside fn (TP's all-gathers under SP, the all-reduces) run again in backward, on
every rank of the group at the same point, so they stay matched.

FP8 scales. The rerun casts with the scales the first forward used, replayed from a ScaleTape
(tensor_parallel/fp8_linear.py), as Transformer Engine does: a delayed-scaling history records
each use's amax once, and the recomputed activations are bitwise the first forward's.

Limits (those of Megatron's reentrant checkpoint too): backward reaches fn only through the
saved tensors, so at least one of them must require grad (a block's input always does: it
comes from the trainable embedding or a pipeline receive); and fn reruns under the autocast
state of backward (minitron's 16-bit training casts the model, it uses no autocast).
"""
from __future__ import annotations

import torch

from ..tensor_parallel.fp8_linear import ScaleTape
from ..tensor_parallel.random import DropoutRNG


def rng_site(rng: DropoutRNG) -> dict:
    """Everything that decides the next dropout masks: the key and any streamed generators."""
    return {"seed": rng._current_seed, "layer": rng._layer, "call": rng._call,
            "first_row": rng._first_row,
            "generators": {key: gen.get_state() for key, gen in rng._generators.items()}}


def restore_rng_site(rng: DropoutRNG, site: dict) -> None:
    rng._current_seed, rng._layer, rng._call = site["seed"], site["layer"], site["call"]
    rng._first_row = site["first_row"]
    for key, state in site["generators"].items():
        rng._generators[key].set_state(state)


class _Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, rng, n_tensors, *args):
        ctx.fn, ctx.rng, ctx.site = fn, rng, rng_site(rng)
        tensors, ctx.others = args[:n_tensors], args[n_tensors:]
        ctx.save_for_backward(*tensors)
        ctx.tape = ScaleTape()                   # FP8: the scales this forward casts with
        with torch.no_grad(), ctx.tape.recording():
            return fn(*tensors, *ctx.others)

    @staticmethod
    def backward(ctx, *grad_outputs):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        now = rng_site(ctx.rng)
        restore_rng_site(ctx.rng, ctx.site)      # the forward's masks, drawn again
        try:
            with torch.enable_grad(), ctx.tape.replay():   # and cast with them again
                outputs = ctx.fn(*inputs, *ctx.others)
        finally:
            restore_rng_site(ctx.rng, now)       # and the RNG as backward found it
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad and g is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads = tuple(t.grad if t.requires_grad else None for t in inputs)
        return (None, None, None) + grads + (None,) * len(ctx.others)


def checkpoint(fn, rng: DropoutRNG, *tensors: torch.Tensor, others: tuple = ()):
    """fn(*tensors, *others), keeping only `tensors` for backward and rerunning fn there.

    Only the tensors are saved; `others` are passed through as they are (modules, configs, the
    rng itself). Without grad (evaluation, torch.no_grad) fn simply runs: nothing to keep."""
    if not torch.is_grad_enabled():
        return fn(*tensors, *others)
    return _Checkpoint.apply(fn, rng, len(tensors), *tensors, *others)
