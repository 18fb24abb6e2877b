"""What every data-parallel engine offers, whatever its ZeRO stage: the interface, once.

    DataParallel  (ddp.py)     ZeRO 0, 1, 2: whole parameters in a flat buffer, gradients in buckets
    ZeroStage3    (zero3.py)   ZeRO 3: the parameters sharded too, gathered one unit at a time

The training loop, ZeroOptimizer (zero.py), the gradient norm (precision.py), the checks
(checks.py) and the checkpoints call only what GradientEngine names, so either engine fits
anywhere. One step:

    engine.zero_grad()
    forward and backward of each micro-batch, all but the last inside engine.no_sync()
    engine.finish_grad_sync()      # owned_grads() now hold the data-parallel mean
    optimizer steps owned_params() with owned_grads(); then engine.after_step()

A piece, (i, t), is a run of one parameter's elements this rank keeps: t holds
p.view(-1)[i:i + t.numel()].
"""
from __future__ import annotations

import abc
import contextlib

import torch
import torch.nn as nn

from ..grid import Grid
from ..runtime.comm import Group

Piece = tuple[int, torch.Tensor]


class GradientEngine(abc.ABC):
    """Averages `model`'s gradients over the grid's data-parallel groups and keeps the pieces of
    parameters and gradients that this rank's optimizer steps.

    Set by every engine: `model`, `grid`, `names` (parameter -> its name in the state dict),
    `zero_stage` (0-3) and `replicas` (grid.dp_replicate: the ranks holding copies of this
    rank's pieces under hybrid sharding; one rank otherwise). ZeroStage3 also has param_pieces(p): its parameters are pieces too.
    """

    model: nn.Module
    grid: Grid
    names: dict[nn.Parameter, str]
    zero_stage: int

    # ---- the training loop -----------------------------------------------------------
    @abc.abstractmethod
    def zero_grad(self) -> None:
        """Start a step: no gradient of the last step is left anywhere."""

    @abc.abstractmethod
    def no_sync(self) -> contextlib.AbstractContextManager:
        """A context for every micro-batch but the last: gradients accumulate, and whatever
        can wait for the last micro-batch is not sent yet."""

    @abc.abstractmethod
    def finish_grad_sync(self) -> None:
        """After the last backward: finish every reduction, so owned_grads() hold the mean
        over the data-parallel replicas (and sequence-parallel gradients their sum over tp)."""

    @abc.abstractmethod
    def after_step(self) -> None:
        """After the optimizer has written owned_params(): bring every rank's copy up to date."""

    @abc.abstractmethod
    def remove_hooks(self) -> None:
        """Detach the engine's autograd and module hooks from the model."""

    # ---- what the optimizer steps ------------------------------------------------------
    @abc.abstractmethod
    def owned_params(self) -> list[torch.Tensor]:
        """The parameter elements this rank updates (flat tensors, written in place)."""

    @abc.abstractmethod
    def owned_grads(self) -> list[torch.Tensor]:
        """Their gradients, one tensor per owned_params() tensor, after finish_grad_sync."""

    # ---- what the gradient norm, the checks and the checkpoints read ---------------------
    @property
    @abc.abstractmethod
    def parameters(self) -> list[nn.Parameter]:
        """Every trainable parameter of the model, each once."""

    @property
    @abc.abstractmethod
    def grads_replicated(self) -> bool:
        """True when every rank of a group holds every gradient whole (plain DP): a norm must
        then count one rank's copy, not the sum of all."""

    @abc.abstractmethod
    def group_of(self, p: nn.Parameter) -> Group:
        """The group across which p's pieces are spread (and its gradient summed, completed
        across `replicas` under hybrid sharding)."""

    @abc.abstractmethod
    def grad_pieces(self, p: nn.Parameter) -> list[Piece]:
        """The pieces of p's reduced gradient this rank keeps (all of it when not sharded)."""

    # ---- memory (data_parallel/memory.py) -----------------------------------------------
    @abc.abstractmethod
    def param_tensors(self) -> list[torch.Tensor]:
        """Every tensor the engine allocates for parameters (whether its storage is live or not)."""

    @abc.abstractmethod
    def grad_tensors(self) -> list[torch.Tensor]:
        """Every tensor the engine allocates for gradients."""

    @property
    @abc.abstractmethod
    def padded_numel(self) -> int:
        """Elements the engine lays out, padding included (so each rank's share is whole)."""
