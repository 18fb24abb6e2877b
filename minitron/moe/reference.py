"""The single-device mixture of experts: the ground truth the expert-parallel layer is checked
against, the tokens a capacity factor drops included.

Deliberately plain: one expert at a time, each applied with F.linear to the tokens that chose
it, so it shares no dispatch code with the parallel layer (only the router's rules). Its
parameters have the parallel layer's names and layout, whole: router.weight [E, h],
experts.fc1.weight [E, ffn, h], experts.fc2.weight [E, h, ffn], ... (experts.py).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .balance import ExpertBias
from .experts import GroupedExperts
from .router import Routing, apply_capacity, aux_losses, route, tokens_per_expert
from ..config import ModelConfig


class MoE(ExpertBias):
    """forward(x [b, s, h]) -> [b, s, h]; after it, `aux_loss` (this layer's auxiliary losses),
    `tokens_per_expert` [E] (choices before dropping) and `routing` (which pairs were kept)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(cfg.hidden, cfg.n_experts, bias=False)
        self.experts = GroupedExperts(cfg, cfg.n_experts)
        # Not in the state dict: updated after each optimizer step from the counts (balance.py)
        self._init_expert_bias(cfg)
        self.aux_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None
        self.routing: Routing | None = None

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e's MLP on x [m, h], the dense MLP's formula."""
        ex = self.experts

        def linear(layer, inp):      # F.linear with expert e's weight (FP8: its own scales)
            return layer.one(e, inp)
        up = linear(ex.fc1, x)
        act = F.silu(linear(ex.gate, x)) * up if self.cfg.activation == "swiglu" else F.gelu(up)
        return linear(ex.fc2, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        flat = x.reshape(-1, h)
        r = route(self.router(flat), self.cfg, self.expert_bias)
        r = apply_capacity(r, self.cfg, rows=b, seq=s)
        counts = tokens_per_expert(r, self.cfg.n_experts)
        self.record_load(counts)
        self.aux_loss = aux_losses(r, self.cfg, counts, b * s)
        self.tokens_per_expert, self.routing = counts, r
        out = torch.zeros_like(flat)
        for e in range(self.cfg.n_experts):
            token, slot = torch.nonzero((r.experts == e) & r.keep, as_tuple=True)
            out = out.index_add(0, token, self.expert(e, flat[token]) * r.gates[token, slot, None])
        return out.view(b, s, h)
