"""The experts one rank holds: one GEMM per expert, each on that expert's block of rows.

Each expert is the dense model's MLP (fc1, activation, fc2; SwiGLU adds a gate). The weights
of the E_local experts on this rank are stacked along a leading expert dimension, in the
layout of nn.Linear (out_features, in_features):

  fc1.weight [E_local, ffn/tp, h]   fc1.bias [E_local, ffn/tp]     (gate.* the same, SwiGLU)
  fc2.weight [E_local, h, ffn/tp]   fc2.bias [E_local, h]

Tensor parallelism splits *inside* each expert, exactly as in the dense MLP: fc1 by columns
(ffn), fc2 by rows, so a tp rank's fc2 output is a partial sum, completed by summing over tp
(the dispatcher does it on the way back). fc2's bias must be added once per token: the
dispatcher says which rows are this rank's to add it to (`bias_rows`).

The tokens arrive sorted by expert with `counts[e]` rows for expert e, so each expert's rows
are one contiguous block: each block meets its expert's weight in one GEMM of exactly its rows
(F.linear), which is what a grouped GEMM (Megatron-Core's, on a GPU) does in one launch. No
zero-padded [E_local, max count, h] tensor is built for a torch.bmm: the busiest expert would
set every expert's row count, and the padded rows' products, computed and thrown away, made an
MoE step at ep=1 take 1.10x the reference's CPU time (`python -m minitron.bench overhead`; 0.95x
without them). An expert's block is the rows the single-device
reference (moe/reference.py) gives that expert, in the same order.

FP8 (--dtype fp8, enable_fp8_experts): each StackedLinear's GEMMs are FP8 GEMMs with a scale per
expert and tensor (tensor_parallel/fp8_batched.py), on the same blocks of rows.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from ..config import ModelConfig
from ..tensor_parallel.fp8 import FP8Recipe
from ..tensor_parallel.fp8_batched import ExpertStates, expert_linear, grouped_fp8


class StackedLinear(nn.Module):
    """E Linear layers of the same shape, weights [E, out, in], bias [E, out]; `fp8`: None, or
    the experts' FP8 scalers (an ExpertStates, enable_fp8_experts)."""

    def __init__(self, n: int, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(n, out_features)) if bias else None
        self.fp8: ExpertStates | None = None

    def forward(self, x: torch.Tensor, counts: list[int], with_bias: bool = True) -> torch.Tensor:
        """x [m, in], sorted by expert (counts[e] rows of expert e) -> [m, out]: each expert's
        block of rows through its own weight, one GEMM per expert."""
        if self.fp8 is not None:
            y = grouped_fp8(x, self.weight, counts, self.fp8.local())
        else:
            y = torch.cat([F.linear(rows, w) for rows, w in zip(x.split(counts), self.weight.unbind(0))])
        return y + self.bias_rows(counts) if with_bias and self.bias is not None else y

    def bias_rows(self, counts: list[int]) -> torch.Tensor:
        """[m, out]: expert e's bias on each of its counts[e] rows."""
        return self.bias.repeat_interleave(torch.tensor(counts, device=self.bias.device), dim=0,
                                           output_size=sum(counts))

    def one(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e alone on x [m, in] (moe/reference.py's loop): F.linear, or in FP8 the dense
        FP8 linear with expert e's own scalers."""
        bias = None if self.bias is None else self.bias[e]
        if self.fp8 is None:
            return F.linear(x, self.weight[e], bias)
        return expert_linear(x, self.weight[e], bias, self.fp8.local()[e])


class GroupedExperts(nn.Module):
    """`n_local` experts, each split `tp` ways inside (tp=1: whole experts)."""

    def __init__(self, cfg: ModelConfig, n_local: int, tp: int = 1):
        super().__init__()
        if cfg.ffn % tp:
            raise ValueError(f"ffn_hidden={cfg.ffn} is not divisible by tp={tp}: each rank must "
                             "own whole columns of every expert; choose a multiple of tp")
        self.cfg, self.n_local, width = cfg, n_local, cfg.ffn // tp
        if cfg.activation == "swiglu":
            self.gate = StackedLinear(n_local, cfg.hidden, width, cfg.bias)
        self.fc1 = StackedLinear(n_local, cfg.hidden, width, cfg.bias)
        self.fc2 = StackedLinear(n_local, width, cfg.hidden, cfg.bias)

    def forward(self, x: torch.Tensor, counts: list[int],
                bias_rows: torch.Tensor | None = None) -> torch.Tensor:
        """x [m, h] sorted by local expert (counts[e] rows each) -> [m, h].

        fc2's bias is added to the rows where `bias_rows` is True (all rows when None)."""
        counts = [int(n) for n in counts]   # m = sum(counts) may be 0: zero weight gradients
        up = self.fc1(x, counts)
        act = F.silu(self.gate(x, counts)) * up if self.cfg.activation == "swiglu" else F.gelu(up)
        y = self.fc2(act, counts, with_bias=False)
        if self.fc2.bias is not None:
            b = self.fc2.bias_rows(counts)
            y = y + (b if bias_rows is None else b * bias_rows[:, None].to(b.dtype))
        return y


def enable_fp8_experts(model: nn.Module, recipe: FP8Recipe, grid=None) -> list[str]:
    """Give every StackedLinear of every GroupedExperts in `model` its experts' FP8 scalers
    (tensor_parallel/fp8_batched.py); returns their names. `grid`: a split model's, whose local
    experts are numbered from ep_rank * E_local and whose amaxes are reduced over tp, then dp x cp
    (fp8_batched's docstring says why not ep); None: the reference, every expert, no reduction."""
    groups = () if grid is None else (grid.tp, grid.dp_cp)
    names = []
    for name, module in model.named_modules():
        if isinstance(module, GroupedExperts):
            first = 0 if grid is None else grid.ep.rank * module.n_local
            for part in ("gate", "fc1", "fc2"):
                linear = getattr(module, part, None)
                if linear is not None:
                    linear.fp8 = ExpertStates(recipe, range(first, first + module.n_local), groups)
                    names.append(f"{name}.{part}")
    return names


# How a tensor of GroupedExperts is cut: expert parallelism always splits dim 0 (expert e on
# ep rank e // E_local); tensor parallelism splits inside each expert along this dimension
# (None: every tp rank holds it whole, like a row-parallel bias).
TP_DIM = {"fc1.weight": 1, "fc1.bias": 1, "gate.weight": 1, "gate.bias": 1,
          "fc2.weight": 2, "fc2.bias": None}


def shard_expert_tensor(full: torch.Tensor, key: str, ep: int, ep_rank: int, tp: int,
                        tp_rank: int) -> torch.Tensor:
    """This rank's piece of an experts' tensor `key` (e.g. "fc1.weight") of shape [E, ...]."""
    mine = full.chunk(ep, 0)[ep_rank]
    dim = TP_DIM[key]
    return (mine if dim is None else mine.chunk(tp, dim)[tp_rank]).clone()


def shard_moe_state_dict(full_sd: dict, ep: int, ep_rank: int, tp: int, tp_rank: int) -> dict:
    """A ParallelMoE's state dict from a reference MoE's (router replicated)."""
    out = {}
    for name, t in full_sd.items():
        if name.startswith("experts."):
            out[name] = shard_expert_tensor(t, name[len("experts."):], ep, ep_rank, tp, tp_rank)
        else:
            out[name] = t.clone()
    return out
