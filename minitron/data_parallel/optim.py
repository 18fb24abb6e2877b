"""FusedAdamW: torch.optim.AdamW's arithmetic, one fused kernel per parameter.

torch.optim.AdamW (single-tensor, fused=False) makes a pass over memory for each of the
decay, the two moment updates, the square root, the division and the update. An optimizer
step is pure memory traffic, so minitron.kernels.fused_adamw_step does the whole step in one
pass: read the weight, its gradient and both moments once, write the weight and the moments
once. The operations and their order are torch's, so the results agree to float32 rounding,
and the state (step, exp_avg, exp_avg_sq) has torch's names: a state dict moves between the
two optimizers.

Parameters must be float32: each parameter is its own fp32 master weight. A mixed-precision
optimizer (lesson on data parallelism and ZeRO) keeps the model in bf16 and the master weights
and moments in fp32, and calls the same function on what it owns:

    fused_adamw_step(master_fp32, grad, exp_avg, exp_avg_sq, ..., model_param=param_bf16)

grad may be bf16 (it is widened in registers) and the kernel writes the rounded bf16 model
copy in the same pass, so no separate cast over the weights is needed. Under ZeRO each
data-parallel rank owns 1/dp of one flattened fp32 buffer of master weights and moments: it
reduce-scatters the gradients, calls fused_adamw_step once on its contiguous shard (one
launch for all parameters, not one per parameter), and all-gathers the updated bf16 weights.
AdamW is elementwise, so stepping shards is stepping the whole.
"""
from __future__ import annotations

import math

import torch

from ..kernels import ops


class FusedAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) with torch.optim.AdamW's defaults and results."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2):
        if not 0.0 <= lr < math.inf:        # NaN fails both comparisons
            raise ValueError(f"FusedAdamW: lr must be finite and >= 0, got {lr}")
        if not 0.0 <= eps < math.inf:        # NaN fails both comparisons
            raise ValueError(f"FusedAdamW: eps must be finite and >= 0, got {eps}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"FusedAdamW: betas must be in [0, 1), got {betas}")
        if not 0.0 <= weight_decay < math.inf:        # NaN fails both comparisons
            raise ValueError(f"FusedAdamW: weight_decay must be finite and >= 0, got {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != torch.float32:
                    raise ValueError(f"FusedAdamW steps float32 parameters (their own master "
                                     f"weights), got {p.dtype}: keep fp32 master weights and "
                                     f"step those (see minitron/optim.py)")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError("FusedAdamW does not take sparse gradients")
                state = self.state[p]
                if not state:   # torch's layout: a CPU float step counter, moments like p
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                state["step"] += 1
                ops.fused_adamw_step(p, p.grad, state["exp_avg"], state["exp_avg_sq"],
                                     lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                                     weight_decay=group["weight_decay"],
                                     step=int(state["step"].item()))
        return loss
