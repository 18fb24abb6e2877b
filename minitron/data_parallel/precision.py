"""Mixed precision: 16-bit weights and activations, fp32 master weights, loss scaling, clipping.

Formats (sign, exponent, mantissa bits; eps = spacing just above 1; largest; smallest normal):
    float32    1, 8, 23   eps 1.2e-7   3.4e38    1.2e-38
    bfloat16   1, 8,  7   eps 7.8e-3   3.4e38    1.2e-38   float32's range, 3 digits
    float16    1, 5, 10   eps 9.8e-4   65504     6.1e-5    more digits, a narrow range

Master weights. An update lr * m/sqrt(v) ~ 1e-4 added to a bf16 weight of 0.02 (spacing 1.2e-4)
is mostly rounded away: the model would stop learning. So the optimizer keeps an fp32 copy of
every weight (and fp32 moments: 12 bytes per parameter), updates that, and writes the rounded
16-bit copy back for the next forward (minitron.data_parallel.ZeroOptimizer; `MasterWeightsAdamW`
below is the same on one device, written with torch.optim.AdamW, the reference).

Loss scaling (fp16 only: bf16 has float32's range). Gradients of ~1e-6 underflow in fp16;
multiplying the loss by S multiplies every gradient by S and lifts them into range. The
optimizer divides by S in fp32. Too large an S overflows to inf: then the step is skipped,
S is halved, and after `growth_interval` good steps in a row S is doubled again (the dynamic
scaler of torch.amp.GradScaler and Megatron's DynamicGradScaler). Every rank must agree to
skip, so the inf check is one all-reduce (max) over all ranks.

Gradient clipping. The norm is over the whole model, which no rank holds: each rank sums the
squares of the gradient elements it is responsible for and one all-reduce adds them up.
Each element must be counted exactly once, though many are held by several ranks:
  * a parameter replicated over tp (norm weights, row-parallel biases, positions) by tp rank 0;
  * a gradient every data-parallel rank holds whole (plain DP) by data-parallel rank 0;
    under ZeRO each rank counts its own shard, which no other rank has;
  * a tied embedding held by the first and the last pipeline stage (marked
    `shared_embedding = True` on the last stage's copy) by the first stage only.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from ..runtime import comm
from .engine_api import GradientEngine

# 16-bit comparisons (tests; verify --dtype holds 16-bit runs to their measured noise instead,
# verify/noise.py, where this bar let a 1% error pass): both sides round every op's output to 16 bits,
# but in different places: a data-parallel rank sums the gradient over half the tokens and
# rounds, the halves are scaled by 1/2 and summed in 16 bits by the all-reduce (two more
# roundings), and the loss is averaged in two steps. So results differ by a few roundings of
# the partial sums, which may exceed the total (cancellation): tol = C16 * eps16 relative to
# the tensor's largest entry. Measured (tests/test_precision.py, bf16 and fp16, dp 2, tp 2 + SP,
# dropout): at most 3.0 eps16, on the norm weights' and biases' gradients (sums over every
# token); C16 = 8 leaves a margin of 2.7. (A 1% error is then invisible in bf16, whose eps is
# 0.8%: 16-bit runs catch gross errors; float32 runs are the fine check.)
C16 = 8


def tolerance16(dtype: torch.dtype) -> float:
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"tolerance16 is for bfloat16 or float16, got {dtype}")
    return C16 * torch.finfo(dtype).eps


def world_group() -> comm.Group:
    """Every rank (torch's default group): agreeing on a skip, summing a global norm."""
    n = dist.get_world_size() if dist.is_initialized() else 1
    return comm.Group("world", range(n))


# ---- loss scaling ------------------------------------------------------------------------------
class LossScaler:
    """Dynamic loss scale: back off on inf/NaN, grow after `growth_interval` good steps."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, min_scale: float = 1.0):
        if not (growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1):
            raise ValueError(f"LossScaler needs growth_factor > 1, 0 < backoff_factor < 1 and "
                             f"growth_interval >= 1; got {growth_factor}, {backoff_factor}, "
                             f"{growth_interval}")
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.min_scale = growth_interval, min_scale
        self.good_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def found_overflow(self, grads: list[torch.Tensor], group: comm.Group | None = None) -> bool:
        """Whether any rank's gradients hold an inf or NaN (collective over `group`: all ranks)."""
        bad = any(not torch.isfinite(g).all() for g in grads)
        device = grads[0].device if grads else "cpu"      # nccl reduces GPU tensors only
        flag = torch.tensor([1.0 if bad else 0.0], device=device)
        comm.all_reduce(flag, group or world_group(), op="max")
        return bool(flag.item())

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0


# ---- global gradient norm ----------------------------------------------------------------------
def _tp_replicated(model: nn.Module, grid) -> set[str]:
    """Names of parameters every tp rank holds whole (the model says: ParallelGPT.tp_replicated)."""
    if grid.tp.size == 1:
        return set()
    return model.tp_replicated()


def _counted_here(engine: GradientEngine, p: nn.Parameter, name: str, grid, replicated_tp: set[str]) -> bool:
    if name in replicated_tp and grid.tp.rank != 0:
        return False
    if getattr(p, "shared_embedding", False) and not grid.is_first_stage:
        return False
    if engine.grads_replicated:                # every rank of p's group holds it: count one
        return engine.group_of(p).rank == 0
    return engine.replicas.rank == 0           # HSDP: each shard's copies count once


def grad_norm(engine: GradientEngine, grid, grad_scale: float = 1.0) -> float:
    """The L2 norm of the whole model's gradient (divided by `grad_scale`), every element
    counted once (module docstring). Collective: every rank calls it."""
    replicated_tp = _tp_replicated(engine.model, grid)
    total = torch.zeros((), dtype=torch.float32, device=grid.device)
    for p in engine.parameters:
        if _counted_here(engine, p, engine.names[p], grid, replicated_tp):
            for _, t in engine.grad_pieces(p):
                total += t.float().pow(2).sum()
    comm.all_reduce(total.reshape(1), world_group())
    return math.sqrt(total.item()) / grad_scale


def clip_coefficient(norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: max_norm / (norm + 1e-6), at most 1."""
    return min(1.0, max_norm / (norm + 1e-6))


def optimizer_step(optimizer, engine: GradientEngine, grid, scaler: LossScaler | None = None,
                   max_norm: float | None = None) -> dict:
    """One mixed-precision step after engine.finish_grad_sync(): skip on overflow, unscale,
    clip, step. Returns {'stepped', 'norm', 'scale'} (the scale the gradients carried)."""
    scale = scaler.scale if scaler is not None else 1.0
    if scaler is not None and scaler.found_overflow(engine.owned_grads()):
        scaler.update(True)
        return {"stepped": False, "norm": math.inf, "scale": scale}
    norm = grad_norm(engine, grid, grad_scale=scale) if max_norm is not None else None
    coef = clip_coefficient(norm, max_norm) if max_norm is not None else 1.0
    optimizer.step(grad_scale=scale / coef)
    if scaler is not None:
        scaler.update(False)
    return {"stepped": True, "norm": norm, "scale": scale}


# ---- the single-device reference ---------------------------------------------------------------
class MasterWeightsAdamW:
    """torch.optim.AdamW on fp32 copies of a 16-bit model's weights (one device: the reference).

    step(grad_scale) reads the 16-bit gradients, divides by grad_scale in fp32, steps the
    masters, and writes them back rounded to the model's dtype."""

    def __init__(self, model: nn.Module, **adamw):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.adamw = torch.optim.AdamW(self.masters, **adamw)

    @torch.no_grad()
    def step(self, grad_scale: float = 1.0) -> None:
        for p, m in zip(self.params, self.masters):
            m.grad = p.grad.float() / grad_scale
        self.adamw.step()
        for p, m in zip(self.params, self.masters):
            p.copy_(m)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


__all__ = ["C16", "tolerance16", "LossScaler", "grad_norm", "clip_coefficient", "optimizer_step",
           "MasterWeightsAdamW", "world_group"]
