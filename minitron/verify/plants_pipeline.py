"""The pipeline plants (plants.py), wrapped around the executor's methods: pp-wrong-stage and
pp-stale-grad replace what a stage passes back (executor._Run.backward), pp-drop-w drops one W
(executor._Run.weights)."""
from __future__ import annotations

import torch

from ..tensor_parallel import weight_grad


def _grad_in(kind: str, sent: dict[int, torch.Tensor], grad_in: torch.Tensor,
             grad_out: torch.Tensor | None, stage: int) -> torch.Tensor:
    """What stage `stage` passes back instead of dL/d(input): under pp-wrong-stage the
    gradient of its output it was given (a middle stage only: the last stage's is the loss),
    under pp-stale-grad the one it passed back for the previous micro-batch (`sent`, kept by
    the plant across steps: stage -> last gradient sent)."""
    if kind == "pp-wrong-stage":
        return grad_in if grad_out is None else grad_out
    last = sent.get(stage)
    sent[stage] = grad_in.detach().clone()
    return torch.zeros_like(grad_in) if last is None else last


def passes_back(backward, kind: str, sent: dict[int, torch.Tensor]):
    """executor._Run.backward, then what it left to pass back replaced (_grad_in)."""
    def planted(run, mb: int, s: int, defer: bool) -> None:
        grad_out = None if s == run.last else run.grad_out.get((mb, s))
        backward(run, mb, s, defer)
        if s == 0:
            return
        here = run._local(s - 1)          # the previous stage on this rank, or sent to it
        store, key = (run.grad_out, (mb, s - 1)) if here else (run.grad_in, (mb, s))
        store[key] = _grad_in(kind, sent, store[key], grad_out, s)
    return planted


def drops_first_w(weights):
    """pp-drop-w: executor._Run.weights that drops the W of micro-batch 0 on stage 0."""
    def planted(run, mb: int, s: int) -> None:
        if (mb, s) == (0, 0):
            weight_grad.STORE.queues.pop((mb, s), None)
            return
        weights(run, mb, s)
    return planted
