"""The FP8 scale rows of a verification (--dtype fp8): every scaler's latest scale against one
device's (per-tensor recipes: the scale itself; blockwise and mxfp8: the largest block scale,
tensor_parallel/fp8_blocks.BlockScaler.last), and under mxfp8 that each scale is a power of two."""
from __future__ import annotations

import torch

from ..runtime import comm
from ..tensor_parallel.fp8_batched import ExpertState
from ..tensor_parallel.fp8_linear import SCALERS, named_fp8_states
from .checks import C_SCALE, Row


def _scale_names(ref) -> list[tuple[str, int]]:
    return [(name, k) for name in named_fp8_states(ref) for k in range(len(SCALERS))]


def gathered_scales(model, ref, grid) -> torch.Tensor:
    """The latest scale of every FP8 scaler of the split model, in the reference's order, on
    every rank (0 for a layer of another stage, or an expert of another ep rank; all-reduces,
    max, over pp and ep, and over the amax group for a fine-grained recipe: collective)."""
    mine = named_fp8_states(model)
    out = torch.zeros(len(_scale_names(ref)), device=grid.device)
    # a replica's (dp, cp, ep) gradients are of its own mean loss: dense_dp times the whole
    # batch's, so its gradient scales are 1/dense_dp of one device's (the casts are the same)
    replicas = grid.dense_dp.size
    for i, (name, k) in enumerate(_scale_names(ref)):
        if name in mine and mine[name].scalers()[k].last is not None:
            out[i] = mine[name].scalers()[k].last * (replicas if SCALERS[k] == "grad" else 1)
    if next(iter(named_fp8_states(ref).values())).recipe.fine_grained:
        # a scale per block: each rank's `last` is its own blocks' largest (fp8_blocks.BlockScaler);
        # the largest of the amax group's is the whole tensor's, one device's
        comm.all_reduce(out, grid.groups["amax"], op="max")
    return comm.all_reduce(comm.all_reduce(out, grid.pp, op="max"), grid.ep, op="max")


SCALE_FLOOR = 1 / 16   # log2: an amax one device and a split see a few bf16 roundings apart


def amax_binades(scales: torch.Tensor, reference: torch.Tensor, pow2) -> torch.Tensor:
    """How far apart, in log2, the amaxes behind two scales at least are: |log2(scale ratio)|,
    and for power-of-two scales (mxfp8's E8M0; `pow2` a bool, or one per scale) one binade less,
    clipped at 0. A power-of-two scale keeps only its amax's binade, floor(log2 amax): an amax a
    rounding below 2^e and one a rounding above it give scales one binade apart (seen in the
    twins, and in correct splits: at most 1 scaler of 24 a step, tp2+SP, hidden 32, seeds 0-3),
    so one binade carries no information; k binades apart means the amaxes are at least 2^(k-1)
    apart. Without the clip a twin's one-binade flip made the bar 4 binades (C_NORM x 1), and tiles
    along the wrong dimension (plant fp8-block-wrong-dim: 3 binades off at seed 2) passed."""
    off = (scales.double() / reference.double()).log2().abs()
    return torch.where(torch.as_tensor(pow2, device=off.device), (off - 1).clamp(min=0), off)


def _binade_clipped(ref) -> torch.Tensor:
    """Per scaler: is it judged by amax_binades' clip. mxfp8's dense scalers are; an expert's are
    not: its blocks along the tokens (dW's operands) hold the tokens in the dispatcher's order,
    which under tp x SP is not one device's, so its largest block scale may sit 2 binades off in a
    correct split (ep2 x tp2+SP, tests/test_fp8_experts.py); it keeps the unclipped log2, whose
    bar the twins' own one-binade flips widen."""
    states = named_fp8_states(ref)
    return torch.tensor([states[n].recipe.scaling == "mxfp8" and not isinstance(states[n], ExpertState)
                         for n, _ in _scale_names(ref)])


def scale_row(step: int, scales: torch.Tensor, ref, twins) -> Row:
    """With the amaxes reduced over tp x cp x ep x dp every cast must use the scale one device uses:
    the largest amax_binades(scale, the reference's) over every scaler, against C_SCALE times the
    twins' (at least SCALE_FLOOR: 4%, a few roundings of a bf16 amax)."""
    def of(model):
        states = named_fp8_states(model)
        return torch.stack([states[n].scalers()[k].last.float().reshape(()) for n, k in _scale_names(ref)])
    r = of(ref).to(scales.device).double()
    clipped = _binade_clipped(ref).to(r.device)
    off = lambda a: amax_binades(a, r, clipped)
    floor = max([float(off(of(t).to(r.device)).max()) for t in twins] + [SCALE_FLOOR])
    diffs = off(scales)
    err, worst = float(diffs.max()), int(diffs.argmax())
    name, k = _scale_names(ref)[worst]
    detail = "" if err <= C_SCALE * floor else (
        f"{name} {SCALERS[k]} scale {float(scales[worst]):.4g}, one device's {float(r[worst]):.4g}")
    return Row(step, "fp8 scales (log2)", err, C_SCALE * floor, detail)


def pow2_row(step: int, scales: torch.Tensor, ref) -> Row:
    """mxfp8: every scale an E8M0 number, a power of two: |log2 s - round(log2 s)| = 0, bitwise."""
    frac = (scales.double().log2() - scales.double().log2().round()).abs()
    err, worst = float(frac.max()), int(frac.argmax())
    name, k = _scale_names(ref)[worst]
    detail = "" if err == 0 else f"{name} {SCALERS[k]} scale {float(scales[worst]):.6g}, not a power of 2"
    return Row(step, "fp8 mx scales (powers of 2)", err, 0.0, detail)
