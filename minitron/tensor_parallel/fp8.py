"""FP8 numbers: the two formats, per-tensor scales, and the recipes that choose them.

Formats (sign, exponent, mantissa bits; eps = spacing just above 1; largest; smallest normal;
smallest subnormal), as torch's float8 dtypes and the Hopper/Blackwell tensor cores hold them:

    E4M3  1, 4, 3   eps 0.125   448     2^-6 = 1.6e-2   2^-9  = 2.0e-3   weights, activations
    E5M2  1, 5, 2   eps 0.25    57344   2^-14 = 6.1e-5  2^-16 = 1.5e-5   gradients

Forward tensors need digits more than range (E4M3); gradients span more binades and tolerate
fewer digits (E5M2), the split of Micikevicius et al. 2022 and Transformer Engine's HYBRID format.

Why a scale per tensor. E4M3 spans only 2^-9 .. 448, 18 binades; a weight of std 0.02 or a
gradient of 1e-5 sits at or below its bottom, where it has no digits left or underflows to 0.
So each tensor x is stored as q = fp8(x * s), with s chosen to bring its largest entry |x|max
(its amax) up to the format's largest value: s = max / amax. Values above max / s saturate
(clamp to +-max: Transformer Engine's cast, and never an inf/NaN). The GEMM multiplies the
FP8 numbers and rescales once: x w = (q_x q_w) / (s_x s_w).

Two recipes choose one s per tensor (two more, blockwise and mxfp8, a scale per block of it:
fp8_blocks.py):
  current   s from this tensor's own amax, just before it is cast: exact, but one more pass
            over the tensor (a reduction) before the cast can start.
  delayed   s from the largest amax of the last `history_len` uses of this tensor (Transformer
            Engine's DelayedScaling with amax_compute_algo="max"): the cast needs no reduction
            first, the amax of this use is recorded on the way and counts from the next use on.
            s = (max / amax) / 2^margin: the margin leaves headroom for growth. What the history
            buys: a tensor that grows between uses is not clipped, as long as it stays below the
            window's largest amax (and margin); what it costs: after one spike the scale stays
            small for history_len uses, and the small entries lose digits (or flush to zero).

Amax reduction. Each rank holds a piece of a logical tensor: a column shard of a weight, its
slice of a row-parallel layer's input features, its rows of the batch (dp), its chunks of the
sequence (cp). Scaled by its own amax, each piece would be cast on its own grid, and no two
ranks (nor one device) would cast the same tensor alike. So, as Megatron-Core configures
Transformer Engine, every amax is all-reduced (max) over the amax group, tp x cp x ep x dp (the
dense replicas, grid.AMAX_DIMS), before a scale is taken from it: every rank casts one
logical tensor with one scale, the scale one device would take (FP8Recipe(reduce_amax=False)
keeps the per-rank amaxes; --no-fp8-amax-reduce). A dp or cp rank's gradients are those of its
own mean loss, dp (or cp) times the whole batch's: a power of 2 on the usual sizes, so the
casts are the same numbers. Here each amax is reduced as it is taken (one small all-reduce per
cast); Transformer Engine reduces all of a step's at once, off the critical path.

When a history is empty (the first use), delayed scaling takes this use's own amax, as
current scaling would. (Transformer Engine starts every scale at 1.0 instead; then the first
step's gradients, ~1e-5, underflow E5M2 and that step is lost.) An amax of 0 or not finite keeps
the previous scale (Transformer Engine's rule), and a scale is at most float32's largest: an amax
of 1e-38 (448 / 1e-38 overflows float32) gives a finite scale, and finite casts.

A scaler's state (its amax history, scale and count of uses) is what a checkpoint keeps
(state_dict / load_state_dict), so a resumed FP8 run casts as the uninterrupted one would.
"""
from __future__ import annotations

import dataclasses

import torch

from ..runtime import comm

E4M3 = torch.float8_e4m3fn     # "fn": finite, no inf; its largest value is 448, not 240
FLOAT32_MAX = float(torch.finfo(torch.float32).max)
E5M2 = torch.float8_e5m2
BLOCK_RECIPES = ("blockwise", "mxfp8")    # a scale per block, fp8_blocks.py
RECIPES = ("delayed", "current") + BLOCK_RECIPES


def fp8_max(fmt: torch.dtype) -> float:
    return float(torch.finfo(fmt).max)


@dataclasses.dataclass(frozen=True)
class FP8Recipe:
    """How the scales are chosen (module docstring). Transformer Engine's DelayedScaling
    defaults are margin 0 and, since TE 1.x, a history of 1024 uses; Megatron's --fp8-amax-
    history-len defaults to 1. 16 is long enough to show what a window does on a short run."""
    scaling: str = "delayed"
    history_len: int = 16
    margin: int = 0
    reduce_amax: bool = True      # all-reduce every amax over tp x cp x ep x dp (module docstring)
    block: int | None = None      # blockwise, mxfp8: the block's length along K (fp8_blocks.py;
                                  # None: 128 and 32, DeepSeek-V3's and the MX spec's)

    def __post_init__(self):
        if self.scaling not in RECIPES:
            raise ValueError(f"FP8 scaling {self.scaling!r}: choose one of {', '.join(RECIPES)}")
        if not (isinstance(self.history_len, int) and self.history_len >= 1):
            raise ValueError(f"FP8 amax history_len must be an integer >= 1, got {self.history_len!r}")
        if not (isinstance(self.margin, int) and self.margin >= 0):
            raise ValueError(f"FP8 margin must be an integer >= 0 (powers of 2), got {self.margin!r}")
        if self.block is not None and (not self.fine_grained or not isinstance(self.block, int)
                                       or self.block < 1):
            raise ValueError(f"FP8 block {self.block!r}: a positive block length, for the "
                             f"{' or '.join(BLOCK_RECIPES)} recipes only (e.g. block=32)")

    @property
    def fine_grained(self) -> bool:
        """A scale per block (fp8_blocks.py) rather than one per tensor."""
        return self.scaling in BLOCK_RECIPES


def quantize(x: torch.Tensor, scale: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """fp8(x * scale), saturated to +-max first; rounding is to nearest, ties to even."""
    big = fp8_max(fmt)
    return (x.float() * scale).clamp(-big, big).to(fmt)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 value an FP8 tensor stands for: q / scale (as q * scale_inv, the GEMM's way)."""
    return q.float() * scale.reciprocal()


def amax(x: torch.Tensor) -> torch.Tensor:
    return x.detach().abs().max().float()


def scale_from_amax(a: torch.Tensor, fmt: torch.dtype, margin: int = 0,
                    previous: torch.Tensor | None = None) -> torch.Tensor:
    """(max / amax) / 2^margin; the previous scale (or 1.0) where amax is 0 or not finite."""
    keep = torch.ones_like(a) if previous is None else previous
    s = (fp8_max(fmt) / a / 2.0 ** margin).clamp(max=FLOAT32_MAX)   # finite for any amax > 0
    return torch.where((a > 0) & torch.isfinite(a), s, keep)


def delayed_scale(history: torch.Tensor, fmt: torch.dtype, margin: int = 0,
                  previous: torch.Tensor | None = None) -> torch.Tensor:
    """The delayed-scaling scale from an amax history: from the largest amax of the window."""
    return scale_from_amax(history.max(), fmt, margin, previous)


class TensorScaler:
    """The scale of one tensor of one layer (its input, weight or output gradient), over uses.

    scale_for(x) returns the scale to cast x with now; under delayed scaling it also records
    x's amax in the history (a ring of the last history_len uses) and computes the next scale.
    `group` (a comm.Group, the amax group): where x's amax is all-reduced (max) first.
    `last` is the scale of the latest cast (the verifier compares it with one device's)."""

    def __init__(self, fmt: torch.dtype, recipe: FP8Recipe, group=None):
        if recipe.fine_grained:
            raise ValueError(f"FP8 recipe {recipe.scaling} has a scale per block, not per tensor: "
                             "fp8_blocks.BlockScaler casts it (or use the delayed or current recipe)")
        self.fmt, self.recipe = fmt, recipe
        self.group = group if recipe.reduce_amax else None
        self.history: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None
        self.last: torch.Tensor | None = None
        self.uses = 0

    def amax_of(self, x: torch.Tensor) -> torch.Tensor:
        """x's amax, the logical tensor's: all-reduced (max) over the amax group."""
        a = amax(x).reshape(1)
        if self.group is not None and self.group.size > 1:
            comm.all_reduce(a, self.group, op="max")
        return a[0]

    def scale_for(self, x: torch.Tensor) -> torch.Tensor:
        self.last = self._scale_for(x)
        return self.last

    def _scale_for(self, x: torch.Tensor) -> torch.Tensor:
        a, margin = self.amax_of(x), self.recipe.margin
        if self.recipe.scaling == "current":
            return scale_from_amax(a, self.fmt, margin)
        if self.history is None:           # first use: no history yet (module docstring)
            self.history = torch.zeros(self.recipe.history_len, device=x.device)
            self.scale = scale_from_amax(a, self.fmt, margin)
        now = self.scale
        self.history[self.uses % self.recipe.history_len] = a
        self.uses += 1
        self.scale = delayed_scale(self.history, self.fmt, margin, previous=now)
        return now

    # ---- checkpoints: what a resumed run needs to cast as this one would ----
    def state_dict(self) -> dict:
        return {"history": self.history, "scale": self.scale, "uses": self.uses}

    def load_state_dict(self, state: dict) -> None:
        clone = lambda t: None if t is None else t.detach().clone()
        self.history, self.scale, self.uses = clone(state["history"]), clone(state["scale"]), int(state["uses"])


# FP8 against a float32 run (tests/test_fp8.py, lesson 07: what FP8 costs in accuracy). verify
# --dtype fp8 no longer uses this bar: it compares with one device running the same FP8 GEMMs,
# against that precision's measured noise (verify/noise.py, checks.noise_rows). Every FP8 GEMM
# rounds each entry of both operands to the format (relative error up to eps/2), so one GEMM's
# output is off by about eps/2 relative to its largest entry, and the errors of the layers add
# up; beside them bf16's own roundings (eps 2^-8) are small. So, as the 16-bit bar is C16 * eps16
# (data_parallel/precision.py), the FP8 bar is C8 * eps of the format that made the error:
# E4M3 for what the forward computes (logits, loss), E5M2 for what the backward does (dL/dX
# and every gradient: their output gradients are cast to E5M2). Relative to the tensor's largest
# entry, like the 16-bit bar. Measured (python -m minitron.verify --dtype fp8, tp 1 and 2, SP,
# RMSNorm/SwiGLU/RoPE, tied, no bias, dropout, seeds 0-4, 3 steps): forward at most 0.48 eps_E4M3;
# backward at most 0.58-0.87 eps_E5M2 with current scaling and 1.27 with delayed (margin 0: a
# gradient larger than any in its history saturates). C8 = 2 leaves a margin of 1.6 over that,
# while a stale amax (fp8-stale-amax: 2.4 and 3.4) and a scale applied twice (fp8-double-scale:
# 5.9 and 5.5) fail. (So FP8 runs catch errors of tens of percent: bf16 and float32 runs are the
# fine checks of everything else.)
C8 = 2.0


def tolerance_fp8(forward: bool) -> float:
    return C8 * float(torch.finfo(E4M3 if forward else E5M2).eps)


__all__ = ["E4M3", "E5M2", "RECIPES", "BLOCK_RECIPES", "FP8Recipe", "fp8_max", "quantize", "dequantize", "amax",
           "scale_from_amax", "delayed_scale", "TensorScaler",
           "C8", "tolerance_fp8"]
