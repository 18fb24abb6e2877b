"""One training run's moving parts, built for any grid: the model, its engine, the step.

    run = TrainingRun(model_cfg, ParallelConfig(tp=2, pp=2), zero_stage=1, microbatches=4)
    loss = run.step(tokens, targets, step)     # the global batch on every rank; the global mean loss

The model is always a PipelineGPT (at pp = 1 it holds every stage and runs as ParallelGPT);
data parallelism and ZeRO come from data_parallel (stages 0-2: DataParallel, 3: ZeroStage3),
the optimizer is ZeroOptimizer, clipping precision.optimizer_step. A pipeline runs its
schedule on this replica's rows under no_sync (its micro-batches' gradients add up locally)
and the engine's finish_grad_sync reduces them once. Covered: tp (+sp), pp (+virtual), dp with
ZeRO 0-3. Not yet: cp and ep (the loss and the rows would need their own split), MoE models.
A non-finite loss stops the run (FloatingPointError on every rank) before the update. There
is no loss scaler here yet: when 16-bit training brings one, a step whose gradients overflow
is the scaler's to skip; the loss itself (the forward) is what it cannot repair.
"""
from __future__ import annotations

import contextlib
import math

import torch

from . import comm
from .data_parallel import DataParallel, ZeroOptimizer, ZeroStage3, forward_backward, local_rows
from .grid import ParallelConfig, build_grid
from .model.config import ModelConfig, check_number
from .pipeline.executor import run_schedule
from .pipeline.partition import PipelineGPT
from .pipeline.schedules import make_schedule
from .precision import optimizer_step


def check_supported(pcfg: ParallelConfig, mcfg: ModelConfig, zero_stage: int) -> None:
    """ValueError naming the fix for what the training run does not cover yet."""
    if pcfg.cp > 1 or pcfg.ep > 1:
        raise ValueError(f"the trainer covers tp, pp and dp so far; cp={pcfg.cp}, ep={pcfg.ep} "
                         "are not wired into it yet: use cp=1 and ep=1")
    if mcfg.n_experts:
        raise ValueError("the trainer and checkpoints do not cover MoE models yet: n_experts=0")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero stage must be 0, 1, 2 or 3, got {zero_stage}")
    if zero_stage == 3 and mcfg.tie_embeddings:
        raise ValueError("ZeRO-3 does not handle tied embeddings: use --zero 0-2 or untied embeddings")


def _units(model: PipelineGPT) -> list:
    """ZeRO-3's gather units: one per module this rank holds (layers sit in a ModuleDict)."""
    names = ("embedding", "final_norm", "lm_head")
    first = [model.embedding] if model.holds_first else []
    last = [getattr(model, n) for n in names[1:] if hasattr(model, n)]
    return first + list(model.layers.values()) + last


class TrainingRun:
    """Model, engine and optimizer of this rank; `step` trains one global batch."""

    def __init__(self, mcfg: ModelConfig, pcfg: ParallelConfig, *, zero_stage: int = 0,
                 microbatches: int = 1, schedule: str | None = None, lr: float = 1e-3,
                 weight_decay: float = 0.0, max_norm: float | None = 1.0, seed: int = 0,
                 dtype: torch.dtype = torch.float32):
        check_supported(pcfg, mcfg, zero_stage)
        check_number("lr", lr, "the learning rate", 1e-3)
        check_number("weight_decay", weight_decay, "the weight decay", 0.0, allow_minimum=True)
        if max_norm is not None:
            check_number("max_norm", max_norm, "the clipping norm (None: no clipping)", 1.0)
        self.grid = grid = build_grid(pcfg)
        self.microbatches, self.max_norm = microbatches, max_norm
        self.schedule = None
        if pcfg.pp > 1 or pcfg.virtual_pp > 1:
            name = schedule or ("interleaved" if pcfg.virtual_pp > 1 else "1f1b")
            self.schedule = make_schedule(name, pcfg.pp, microbatches, pcfg.virtual_pp)
        placement = self.schedule.stage_rank if self.schedule is not None else None
        self.model = PipelineGPT(mcfg, grid, placement, seed=seed).to(dtype)
        if zero_stage == 3:
            self.engine = ZeroStage3(self.model, grid, units=_units(self.model))
        else:
            self.engine = DataParallel(self.model, grid, zero_stage=zero_stage)
        self.optimizer = ZeroOptimizer(self.engine, lr=lr, weight_decay=weight_decay)

    def step(self, tokens: torch.Tensor, targets: torch.Tensor, step: int) -> float:
        """Forward, backward and update on the global batch; returns its mean loss (every rank)."""
        model, engine, grid = self.model, self.engine, self.grid
        tokens, targets = tokens.to(grid.device), targets.to(grid.device)
        engine.zero_grad()
        if self.schedule is None:
            loss = forward_backward(model, engine, tokens, targets, micro_batches=self.microbatches,
                                    step_seed=step).detach()
        else:
            rows = local_rows(tokens.shape[0], grid)
            model.rng.reset(step)
            quiet = engine.no_sync() if hasattr(engine, "no_sync") else contextlib.nullcontext()
            with quiet:
                result = run_schedule(self.schedule, model, tokens[rows], targets[rows],
                                      first_row=rows.start, keep_outputs=False, finalize_grads=False)
            loss = result.loss.detach() if result.loss is not None else None
            loss = loss if model.holds_last else torch.zeros((), device=grid.device)
            loss = comm.all_reduce(loss.float().clone().reshape(1), grid.pp)[0]  # from the last stage
        engine.finish_grad_sync()
        value = self.global_loss(loss)     # before the update: a diverged step changes nothing
        if not math.isfinite(value):
            raise FloatingPointError(f"step {step + 1}: the loss is {value}: the run diverged "
                                     "(the weights are left as they were before it); lower the "
                                     "learning rate, or resume from an earlier checkpoint")
        optimizer_step(self.optimizer, engine, grid, None, max_norm=self.max_norm)
        return value

    def global_loss(self, loss: torch.Tensor) -> float:
        """The mean over the data-parallel replicas (each holds the mean of its rows)."""
        total = comm.all_reduce(loss.float().clone().reshape(1), self.grid.dp)
        return float(total[0]) / self.grid.dp.size

    @torch.no_grad()
    def evaluate(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """The mean loss on a global batch, no update, dropout off (every rank takes part). A
        pipeline runs stage by stage, each stage's output broadcast over pp (plain and slow:
        evaluation is rare)."""
        model, grid = self.model, self.grid
        rows = local_rows(tokens.shape[0], grid)
        tokens, targets = tokens[rows].to(grid.device), targets[rows].to(grid.device)
        model.eval()
        try:
            if self.schedule is None:
                return self.global_loss(model(tokens, targets)[1])
            seq = tokens.shape[1] // (grid.tp.size if grid.sequence_parallel else 1)
            x = model.embed(tokens) if model.holds_first else \
                torch.empty(tokens.shape[0], seq, model.cfg.hidden, device=grid.device,
                            dtype=next(model.parameters()).dtype)
            last = model.n_stages - 1
            for s in range(model.n_stages):
                if s in model.stages:
                    x = model.stage_forward(s, x)
                if s < last:
                    x = comm.broadcast(x.contiguous(), grid.pp, src=model.placement[s])
            loss = model.loss(x, targets) if model.holds_last else torch.zeros((), device=grid.device)
            return self.global_loss(comm.all_reduce(loss.float().reshape(1).clone(), grid.pp)[0])
        finally:
            model.train()
