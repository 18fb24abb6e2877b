"""The one training engine: model, data-parallel engine, schedule and optimizer for any grid.

    run = TrainingRun(model_cfg, ParallelConfig(tp=2, pp=2, dp=2), zero_stage=1, microbatches=4)
    loss = run.step(tokens, targets, step)     # the global batch on every rank; its mean loss

Every training step in minitron goes through here: python -m minitron.train, python -m
minitron.verify (which compares the tensors of the same steps with one device), the
benchmarks, the checkpoints and the lessons. What a run splits decides what is built:

  the model      PipelineGPT always: at pp = 1 it holds every stage and runs as ParallelGPT
                 (tp with sp, cp with each variant, ep with MoE layers, recompute, kernels)
  the schedule   with pp > 1, virtual stages or a schedule's name: every step runs the
                 schedule's actions (train/step.py); otherwise micro-batches run one by one
  the engine     data_parallel.wrap: DataParallel (ZeRO 0-2) or ZeroStage3, and ZeroOptimizer
                 on fp32 master shards; with fp16 a loss scaler. Built when the run asks for a
                 ZeRO stage (the default, 0), has dp or ep > 1, or trains in 16 bits;
                 otherwise the model keeps its own .grad and torch's AdamW steps it
                 (FusedAdamW with the kernels), as a plain single-device script would
  the precision  precision.py's `resolve_precision`, the one rule from a name to what a run holds: float32,
                 float64, bfloat16, float16, or fp8 = bfloat16 training (fp32 master weights and
                 Adam states) whose block GEMMs run in FP8 (tensor_parallel/fp8_linear.py)

A step is forward_backward (train/step.py) then optimizer_step, which ends with the experts'
bias update of aux-loss-free balancing (ModelConfig.expert_bias, moe/balance.py: each layer's
load summed over the step's micro-batches and the ranks holding other tokens). grads(), weights() and
load_grads() read and write this rank's tensors in the reference's names, whatever shards
them: the verifier reads the gradients, then loads the reference's and steps both optimizers
on them, so the update is checked on its own.
"""
from __future__ import annotations

import math

import torch

from .. import refusals
from ..context_parallel import shard_sequence
from ..data_parallel import (DEFAULT_BUCKET_NUMEL, gathered_grads, gathered_masters, gathered_params,
                             load_grads, wrap)
from ..data_parallel.optim import FusedAdamW
from ..data_parallel.precision import LossScaler, optimizer_step
from ..grid import ParallelConfig, build_grid
from ..config import ModelConfig, check_number
from ..model.convert import grads_state_dict
from ..moe.balance import update_biases
from ..moe.experts import enable_fp8_experts
from ..moe.router import imbalance
from ..model.stages import PipelineGPT
from ..pipeline.schedules import V_SHAPED, make_schedule
from ..runtime import comm
from ..tensor_parallel.fp8 import FP8Recipe
from ..tensor_parallel.fp8_linear import enable_fp8
from .precision import SIXTEEN_BIT
from .step import NO_HOOKS, StepHooks, StepOutput, forward_backward, replica_rows

def resolve_schedule(pcfg: ParallelConfig, name=None, microbatches: int | None = None):
    """The pipeline Schedule a run steps with, or None (pp = virtual = 1 and no name given).

    A Schedule is kept as it is. Defaults: 1F1B (interleaved with virtual > 1), 2*pp
    micro-batches; ZB-V and DualPipeV always have two chunks per rank."""
    if name is not None and not isinstance(name, str):
        return name
    if name is None and pcfg.pp == 1 and pcfg.virtual_pp == 1:
        return None
    name = name or ("interleaved" if pcfg.virtual_pp > 1 else "1f1b")
    virtual = 2 if name in V_SHAPED and pcfg.virtual_pp == 1 else pcfg.virtual_pp
    return make_schedule(name, pcfg.pp, microbatches or 2 * pcfg.pp, virtual)


def uses_engine(pcfg: ParallelConfig, zero: int | None, dtype: torch.dtype) -> bool:
    """Whether a run steps through a data-parallel engine and ZeroOptimizer."""
    return pcfg.dp > 1 or pcfg.ep > 1 or zero is not None or dtype in SIXTEEN_BIT


def check_supported(pcfg: ParallelConfig, mcfg: ModelConfig, dtype: torch.dtype,
                    zero: int | None, schedule, fp8: FP8Recipe | None = None) -> None:
    """Refuse, before any rank starts, what the engine does not run: the rows of minitron/
    refusals/ up to level engine (Refused, naming the options and what works instead)."""
    if zero not in (None, 0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero!r}")
    refusals.check(refusals.Options.of(pcfg, mcfg, dtype, zero, schedule, fp8), "engine")


class _OwnGrads:
    """No data-parallel engine: the model's own .grad, stepped by torch's AdamW."""
    grads_replicated, zero_stage = True, None

    def __init__(self, model, lr: float, eps: float, weight_decay: float):
        adamw = FusedAdamW if model.cfg.use_kernels else torch.optim.AdamW
        self.model = model
        self.opt = adamw(model.parameters(), lr=lr, eps=eps, weight_decay=weight_decay)

    def grads(self) -> dict:
        return grads_state_dict(self.model)

    def weights(self) -> dict:
        return self.model.state_dict()

    @torch.no_grad()
    def load_grads(self, shards: dict) -> None:
        for name, shard in shards.items():
            p = self.model.get_parameter(name)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.copy_(shard)

    def step(self, max_norm: float | None) -> dict:
        norm = None
        if max_norm is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return {"stepped": True, "norm": norm, "scale": 1.0}


class TrainingRun:
    """This rank's model, engine and optimizer for one configuration; `step` trains one batch.

    schedule: a name (pipeline.schedules.SCHEDULES), a Schedule or None (see resolve_schedule);
    microbatches: of the schedule, or without one the micro-batches each replica's rows are
    cut into (gradient accumulation). zero_stage=None builds no engine where none is needed
    (module docstring: the verifier's plain runs); max_norm=None does not clip; loss_scale:
    fp16's fixed scale (default: a dynamic LossScaler).
    reference: a single-device GPT whose weights and dropout seed the model takes (verify), cast
    to `dtype`. fp8: an FP8Recipe (with dtype=bfloat16): the blocks' GEMMs in FP8 (resolve_precision).
    hooks: what a verifier plants in each step (train/step.py StepHooks)."""

    def __init__(self, mcfg: ModelConfig, pcfg: ParallelConfig, *, schedule=None,
                 microbatches: int | None = None, zero_stage: int | None = 0,
                 dtype: torch.dtype = torch.float32, lr: float = 1e-3, eps: float = 1e-8,
                 weight_decay: float = 0.0, max_norm: float | None = 1.0, seed: int = 0,
                 bucket_numel: int | None = DEFAULT_BUCKET_NUMEL, loss_scale: float | None = None,
                 reference=None, hooks: StepHooks = NO_HOOKS, fp8: FP8Recipe | None = None):
        self.schedule = resolve_schedule(pcfg, schedule, microbatches)
        check_supported(pcfg, mcfg, dtype, zero_stage, self.schedule, fp8)
        check_number("lr", lr, "the learning rate", 1e-3)
        check_number("weight_decay", weight_decay, "the weight decay", 0.0, allow_minimum=True)
        if max_norm is not None:
            check_number("max_norm", max_norm, "the clipping norm (None: no clipping)", 1.0)
        self.grid = grid = build_grid(pcfg)
        self.cfg, self.hooks, self.max_norm = mcfg, hooks, max_norm
        self.microbatches = 1 if self.schedule is not None else (microbatches or 1)
        self.placement = self.schedule.stage_rank if self.schedule is not None else None
        if reference is not None:
            self.model = PipelineGPT.from_reference(reference, grid, self.placement).to(dtype)
        else:
            self.model = PipelineGPT(mcfg, grid, self.placement, seed=seed).to(dtype)
        self.fp8 = fp8
        self.fp8_layers = enable_fp8(self.model, fp8, grid.groups["amax"]) + \
            enable_fp8_experts(self.model, fp8, grid) if fp8 is not None else []
        self.scaler, self.loss_scale = None, 1.0
        if not uses_engine(pcfg, zero_stage, dtype):
            self.engine, self.side = None, _OwnGrads(self.model, lr, eps, weight_decay)
            return
        self.zero_stage = zero_stage or 0
        self.engine, self.optimizer = wrap(self.model, grid, self.zero_stage, bucket_numel, lr=lr,
                                           eps=eps, weight_decay=weight_decay)
        self.side = None
        if dtype == torch.float16:
            self.scaler = LossScaler() if loss_scale is None else \
                LossScaler(loss_scale, growth_interval=10**9)     # a fixed scale
            self.loss_scale = self.scaler.scale

    # ---- one step ----
    def forward_backward(self, tokens: torch.Tensor, targets: torch.Tensor, step_seed: int,
                         keep_outputs: bool = False) -> StepOutput:
        """Forward and backward of the global batch (the same on every rank); gradients final."""
        if self.scaler is not None:
            self.loss_scale = self.scaler.scale
        return forward_backward(self.model, self.schedule, tokens.to(self.grid.device),
                                targets.to(self.grid.device), step_seed, engine=self.engine,
                                hooks=self.hooks, microbatches=self.microbatches,
                                loss_scale=self.loss_scale, keep_outputs=keep_outputs)

    def optimizer_step(self) -> dict:
        """Unscale, clip (max_norm), step and zero the gradients; {'stepped', 'norm', 'scale'}.
        Then, with expert biases, move each by the step's load (collective over the load groups;
        also when fp16's scaler skipped the step: the counts are real, moe/balance.py)."""
        if self.engine is None:
            out = self.side.step(self.max_norm)
        else:
            out = optimizer_step(self.optimizer, self.engine, self.grid, self.scaler, max_norm=self.max_norm)
            self.engine.zero_grad()
        self.expert_loads = update_biases(self.model.moe_layers())   # [layers, E] or None
        return out

    def step(self, tokens: torch.Tensor, targets: torch.Tensor, step: int) -> float:
        """Forward, backward and update on the global batch; returns its mean loss (every rank).

        A non-finite loss stops the run (FloatingPointError on every rank: they all hold the
        same value) before the update, so the weights stay as they were. Gradients that overflow
        in float16 are the loss scaler's to skip; a loss that is itself NaN or inf it cannot
        repair."""
        loss = float(self.forward_backward(tokens, targets, step).loss)
        if not math.isfinite(loss):
            raise FloatingPointError(f"step {step + 1}: the loss is {loss}: the run diverged (the "
                                     "weights are left as they were before it); lower the "
                                     "learning rate, or resume from an earlier checkpoint")
        self.last_update = self.optimizer_step()
        return loss

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next optimizer steps (a schedule sets it every step)."""
        if self.engine is None:
            for group in self.side.opt.param_groups:
                group["lr"] = lr
        else:
            self.optimizer.lr = lr

    def health(self) -> dict:
        """What a progress line shows besides the loss: the last step's gradient norm, the loss
        scale (fp16), the experts' load balance (max / mean tokens per expert, worst layer)."""
        out = {}
        norm = getattr(self, "last_update", {}).get("norm")
        if norm is not None:
            out["grad_norm"] = float(norm)
        if self.scaler is not None:
            out["loss_scale"] = self.scaler.scale
        counts = [m.tokens_per_expert for m in self.model.moe_layers() if m.tokens_per_expert is not None]
        if counts:
            out["expert_load"] = max(imbalance(c) for c in counts)
        return out

    # ---- this rank's tensors in the reference's names (verify, checkpoints) ----
    @property
    def sharded_grads(self) -> bool:
        """Gradients rebuilt from shards (ZeRO 1-3): equal over dp by construction."""
        return self.engine is not None and not self.engine.grads_replicated

    @property
    def sharded_weights(self) -> bool:
        return self.engine is not None and self.zero_stage == 3

    def grads(self) -> dict:
        return self.side.grads() if self.engine is None else gathered_grads(self.engine)

    def weights(self) -> dict:
        return self.side.weights() if self.engine is None else gathered_params(self.engine)

    def masters(self) -> dict | None:
        """{name: fp32 master weight} of a 16-bit run, what its optimizer steps (None when the
        model is its own master: float32)."""
        if self.engine is None or self.optimizer.master_is_model:
            return None
        return gathered_masters(self.engine, self.optimizer.master)

    def load_grads(self, shards: dict) -> None:
        """Replace this rank's gradients by `shards` (its shards of another model's gradients)."""
        if self.engine is None:
            self.side.load_grads(shards)
        else:
            load_grads(self.engine, shards)

    # ---- evaluation ----
    @torch.no_grad()
    def evaluate(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """The mean loss on a global batch, no update, dropout off (every rank takes part). A
        pipeline runs stage by stage, each stage's output broadcast over pp (plain and slow:
        evaluation is rare)."""
        model, grid = self.model, self.grid
        rows = replica_rows(tokens.shape[0], grid)
        cp = grid.cp
        tokens = shard_sequence(tokens[rows].to(grid.device), cp.size, cp.rank)
        targets = shard_sequence(targets[rows].to(grid.device), cp.size, cp.rank)
        model.eval()
        try:
            if self.schedule is None:
                loss = model(tokens, targets)[1].float().reshape(1)
            else:
                loss = self._evaluate_stages(tokens, targets)
        finally:
            model.train()
        replicas = grid.ep_dp
        loss = comm.all_reduce(loss.clone(), cp) / cp.size if cp.size > 1 else loss
        return float(comm.all_reduce(loss.clone(), replicas)[0]) / replicas.size

    def _evaluate_stages(self, tokens, targets) -> torch.Tensor:
        model, grid = self.model, self.grid
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
        return comm.all_reduce(loss.float().reshape(1).clone(), grid.pp)
