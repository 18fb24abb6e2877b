"""ZeRO: the optimizer (stages 1-2) and then the parameters themselves (stage 3), sharded over dp.

Mixed-precision Adam keeps, per parameter, 2 bytes of 16-bit weight, 2 of 16-bit gradient and
12 of optimizer state (fp32 master weight, first and second moment): 16 bytes, replicated on
every data-parallel rank. ZeRO (Rajbhandari et al. 2020) stops replicating; at Ψ parameters
and N ranks, per rank:

    plain DP   2Ψ + 2Ψ + 12Ψ         all-reduce the gradients
    stage 1    2Ψ + 2Ψ + 12Ψ/N       reduce-scatter grads, step my 1/N, all-gather weights
    stage 2    2Ψ + 2Ψ/N + 12Ψ/N     ... and keep only my 1/N of the gradients
    stage 3    2Ψ/N + 2Ψ/N + 12Ψ/N   ... and of the weights: gather each layer when needed

Stages 1 and 2 send what plain DP sends (a ring all-reduce is a reduce-scatter plus an
all-gather); stage 3 gathers the weights twice (forward, and again for backward: they were
freed in between), so it sends 1.5 times as much. memory.py has the formulas; tests measure.

ZeroOptimizer is AdamW (torch.optim.AdamW's arithmetic: decoupled decay, bias correction) on
fp32 master copies of the elements this rank owns, in one call over its whole flat shard
(kernels/ops.fused_adamw_step: Triton on GPUs, torch's fused kernel on CPU, each element rounded
alike wherever a shard boundary falls, so a replica held at two offsets stays bitwise one). AdamW is elementwise, so stepping every
rank's shard is stepping the whole model. It reads its shards from an engine: DataParallel
(ddp.py, stages 0-2; stage 0 owns everything) or ZeroStage3 (zero3.py). One training step:

    engine = DataParallel(model, grid, zero_stage=1)    # or ZeroStage3(model, grid)
    opt = ZeroOptimizer(engine, lr=1e-4, weight_decay=0.01)
    engine.zero_grad(); loss.backward(); engine.finish_grad_sync(); opt.step()
"""
from __future__ import annotations

import math

import torch

from ..kernels import ops
from .engine_api import GradientEngine


class ZeroOptimizer:
    """AdamW on fp32 master weights of the owned elements; writes back the 16-bit weights.

    `step(grad_scale=s)` divides the gradients by s first (in fp32): loss scaling and
    gradient clipping fold into it (minitron.data_parallel.precision)."""

    def __init__(self, engine: GradientEngine, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2):
        finite = all(0 <= x < math.inf for x in (lr, eps, weight_decay))   # NaN fails both
        if not finite or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"ZeroOptimizer: need finite lr, eps, weight_decay >= 0 and betas in [0, 1); "
                             f"got lr={lr}, eps={eps}, weight_decay={weight_decay}, betas={betas}")
        self.engine = engine
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay
        owned, in_place = one_flat(engine.owned_params())
        # An fp32 model is its own master copy: step its owned elements in place (no second
        # copy, nothing to write back). A 16-bit model gets fp32 masters.
        self.master_is_model = in_place and owned.dtype == torch.float32
        self.master = owned if self.master_is_model else owned.detach().float().clone()
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.step_count = 0

    @torch.no_grad()
    def step(self, grad_scale: float = 1.0) -> None:
        grads = one_flat(self.engine.owned_grads())[0].float()   # no copy for fp32 in one piece
        if grad_scale != 1.0:
            grads = grads / grad_scale              # not in place: it may be the engine's buffer
        self.step_count += 1
        beta1, beta2 = self.betas
        ops.fused_adamw_step(self.master, grads, self.exp_avg, self.exp_avg_sq, lr=self.lr,
                             beta1=beta1, beta2=beta2, eps=self.eps,
                             weight_decay=self.weight_decay, step=self.step_count)
        if not self.master_is_model:
            owned = self.engine.owned_params()
            for param, master in zip(owned, self.master.split([t.numel() for t in owned])):
                param.copy_(master)                 # rounds to the model's dtype
        self.engine.after_step()

    def state_tensors(self) -> list[torch.Tensor]:
        """What this optimizer adds: the moments, and the fp32 masters unless they are the model."""
        masters = [] if self.master_is_model else [self.master]
        return masters + [self.exp_avg, self.exp_avg_sq]


def one_flat(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, bool]:
    """(`tensors` end to end as one flat tensor, whether that is a view of theirs): a view when
    they lie end to end in one storage (one bucket, a stage-3 shard), else a copy."""
    first = tensors[0]
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for t in tensors:
        if (not t.is_contiguous() or t.untyped_storage().data_ptr() != storage
                or t.storage_offset() != offset):
            return torch.cat([t.reshape(-1) for t in tensors]), False
        offset += t.numel()
    return first.as_strided((offset - first.storage_offset(),), (1,)), True
