"""Splitting a linear layer's backward into B (dL/dX now) and W (dL/dW later): zero bubble's trick.

For y = x W^T + b the backward is two independent GEMMs:

    B:  dL/dx = dL/dy W          needed at once: the previous pipeline stage is waiting for it
    W:  dL/dW = dL/dy^T x        needed only by the optimizer step, after the last micro-batch

Zero-bubble pipeline schedules (Qi et al. 2024) run B when the gradient arrives and push W into
the bubbles. The mechanism is sail-sg/zero-bubble's WeightGradStore: inside the linear layers'
matmul (a small autograd Function), when deferral is on, backward returns dL/dx and queues the
dL/dW (and dL/db) computation as a closure under the key of the work being run, a
(micro-batch, stage) pair; W pops that key's closures and runs them, accumulating into .grad.

Deferral is off by default, and then the layers call F.linear exactly as before. `capture()`
routes the layers through DeferrableLinear (the executor's forward passes); whether a given
backward defers is decided when it runs: inside `deferring(key)` it queues, otherwise it computes
dL/dW at once (a full backward, BW).

Hooks (ZeRO-3 counts each parameter's gradient contributions, data_parallel/zero3.py): a deferred
gradient reaches .grad outside autograd, so `register_grad_hook(param, hook)` is this module's
Tensor.register_post_accumulate_grad_hook: hook(param) runs after a W accumulated into it.
Autograd still calls a deferred parameter's own post-accumulate hooks during B, with nothing
accumulated; `waiting(param)` tells such a call apart (the parameter's W is queued).
"""
from __future__ import annotations

import collections
import contextlib
from typing import Callable, Hashable

import torch
import torch.nn.functional as F
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary


class WeightGradStore:
    """Deferred weight-gradient closures, by key. One store per process (`STORE`)."""

    def __init__(self):
        self.capturing = False                   # forward: build DeferrableLinear nodes
        self.key: Hashable | None = None         # backward: queue under this key (None: compute now)
        self.queues: dict[Hashable, list[tuple[Callable[[], None], int]]] = {}
        self.waiting = WeakIdKeyDictionary()     # parameter -> its queued closures, not yet run
        self.grad_hooks = WeakIdKeyDictionary()  # parameter -> {handle id: hook(param)}

    def put(self, closure: Callable[[], None], nbytes: int) -> None:
        """Queue one layer's dL/dW computation; `nbytes`: what the closure alone keeps alive."""
        self.queues.setdefault(self.key, []).append((closure, nbytes))

    def pop(self, key: Hashable) -> int:
        """Run (and forget) every closure queued under `key`; returns how many ran."""
        closures = self.queues.pop(key, [])
        for closure, _ in closures:
            closure()
        return len(closures)

    def pending_bytes(self) -> int:
        """Bytes held only by queued closures (the output gradients they will multiply)."""
        return sum(n for queue in self.queues.values() for _, n in queue)

    def clear(self) -> None:
        self.queues.clear()
        self.waiting.clear()


def register_grad_hook(param: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> RemovableHandle:
    """Call hook(param) each time a W has accumulated into param.grad (see the module doc)."""
    hooks = STORE.grad_hooks.setdefault(param, collections.OrderedDict())   # weak-referenceable
    handle = RemovableHandle(hooks)
    hooks[handle.id] = hook
    return handle


def waiting(param: torch.Tensor) -> bool:
    """Whether dL/d(param) has W closures queued (so a B just skipped it)."""
    return STORE.waiting.get(param, 0) > 0


STORE = WeightGradStore()


@contextlib.contextmanager
def capture():
    """Forward passes inside build deferrable linear nodes (their backward may defer dL/dW)."""
    before, STORE.capturing = STORE.capturing, True
    try:
        yield STORE
    finally:
        STORE.capturing = before


@contextlib.contextmanager
def deferring(key: Hashable):
    """Backward passes inside queue dL/dW of deferrable nodes under `key` instead of computing it."""
    before, STORE.key = STORE.key, key
    try:
        yield STORE
    finally:
        STORE.key = before


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad
    STORE.waiting[param] = STORE.waiting.get(param, 1) - 1
    for hook in tuple(STORE.grad_hooks.get(param, {}).values()):
        hook(param)


def defer(params: tuple, compute: Callable[[], tuple], nbytes: int) -> bool:
    """Inside `deferring`, queue compute() -> the gradients of `params` (None: that one has none)
    under the current key and return True; outside it return False (the caller computes them
    now). Every deferrable GEMM's backward (DeferrableLinear's, FP8's) goes through here."""
    if STORE.key is None:
        return False

    @torch.no_grad()   # W runs outside autograd's backward: build no graph through x
    def weight_grad():
        for p, g in zip(params, compute()):
            if p is not None:
                _accumulate(p, g)
    STORE.put(weight_grad, nbytes)
    for p in params:
        if p is not None:
            STORE.waiting[p] = STORE.waiting.get(p, 0) + 1
    return True


class DeferrableLinear(torch.autograd.Function):
    """y = x W^T (+ b), whose backward computes dL/dW now or queues it (see the module doc)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.params = (weight, bias)    # the parameters themselves: a deferred W accumulates into them
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        w_param, b_param = ctx.params
        grad_x = grad_y @ weight
        g2, x2 = grad_y.reshape(-1, grad_y.shape[-1]), x.reshape(-1, x.shape[-1])

        def weight_grads():
            return g2.t() @ x2, None if b_param is None else g2.sum(0)
        if defer(ctx.params, weight_grads, grad_y.numel() * grad_y.element_size()):
            return grad_x, None, None
        return (grad_x, *weight_grads())           # a full backward: both gradients now


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, or a DeferrableLinear node while the store is capturing."""
    if not STORE.capturing:
        return F.linear(x, weight, bias)
    return DeferrableLinear.apply(x, weight, bias)
