"""The FP8 plants fp8-* (plants.py, --dtype fp8): each patches the scaling of every FP8 layer's
GEMMs (tensor_parallel/fp8_linear.py): a stale amax history, the weight's scale divided out
twice, scaling off, E5M2 in the forward, the input scaled by the weight's amax; under the
fine-grained recipes (fp8_blocks.py) one scale for the whole tensor instead of one per block,
MX scales that are not powers of two, and tiles along the wrong dimension. The fp8-experts-*
plants patch the experts' GEMMs only (tensor_parallel/fp8_batched.py): every scale 1, or E5M2
in their forward; the dense layers stay right."""
from __future__ import annotations

import torch

from ..tensor_parallel.fp8 import E4M3, E5M2, delayed_scale, scale_from_amax
from ..tensor_parallel.fp8_batched import ExpertState
from ..tensor_parallel.fp8_blocks import block_amax, quantize_blocks
from ..tensor_parallel.fp8_linear import named_fp8_states
from .patching import patched


def install_fp8(kind: str, model) -> None:
    """Put the scaling fault `kind` into every FP8 layer of `model` (its own objects patched)."""
    states = list(named_fp8_states(model).values())       # the experts' one by one
    if kind.startswith("fp8-experts-"):
        return _install_in_experts(kind, [s for s in states if isinstance(s, ExpertState)])
    for state in states:
        if kind in BLOCK_PLANTS:
            _break_blocks(state, kind)
        elif kind == "fp8-double-scale":
            _divide_weight_scale_twice(state)
        elif kind == "fp8-unscaled":
            for scaler in state.scalers():
                scaler._scale_for = lambda x: torch.ones((), device=x.device)
        elif kind == "fp8-e5m2-forward":
            _cast_forward_to_e5m2(state)
        elif kind == "fp8-wrong-amax":
            _input_scaled_by_weight(state)
        else:
            for scaler in state.scalers():
                _hold_stale_amax(scaler, 1.0)


def _install_in_experts(kind: str, states: list) -> None:
    """fp8-experts-unscaled: every scale of the experts' GEMMs is 1 (their small weights and
    gradients lose their digits or underflow); fp8-experts-e5m2-forward: their inputs and
    weights cast to E5M2 (scaled to its range), the grouped GEMM casting with its scalers' format.
    Under blockwise or mxfp8 (BlockScalers) unscaled is every block's scale 1. A rank whose
    model holds no experts (a pipeline stage without an MoE layer) has none to break."""
    for state in states:
        if kind == "fp8-experts-unscaled" and state.recipe.fine_grained:
            for sc in state.scalers():
                sc.quantize = lambda x, rows, cols, sc=sc: quantize_blocks(
                    x, sc.fmt, rows, cols, sc.pow2, scales=torch.ones_like(block_amax(x, rows, cols)))
        elif kind == "fp8-experts-unscaled":
            for scaler in state.scalers():
                scaler._scale_for = lambda x: torch.ones((), device=x.device)
        elif kind == "fp8-experts-e5m2-forward":
            state.input.fmt = state.weight.fmt = E5M2
        else:
            raise ValueError(f"unknown experts' FP8 plant {kind!r}")


def _hold_stale_amax(scaler, stale: float) -> None:
    """fp8-stale-amax: the scaler's amax history holds `stale`, recorded before, and is never
    written again, so every scale comes from it (max / stale), whatever the tensor's amax."""
    def scale_for(x: torch.Tensor) -> torch.Tensor:
        scaler.history = torch.full((scaler.recipe.history_len,), stale, device=x.device)
        return delayed_scale(scaler.history, scaler.fmt, scaler.recipe.margin)
    scaler._scale_for = scale_for


def _cast_forward_to_e5m2(state) -> None:
    """fp8-e5m2-forward: the input's and weight's scalers take E5M2's range, and while the
    layer's forward runs its E4M3 casts are E5M2 casts."""
    from ..tensor_parallel import fp8_linear
    linear = state.linear
    state.input.fmt = state.weight.fmt = fp8_linear.E5M2

    def planted(x, weight, bias):
        with patched(fp8_linear, "E4M3", fp8_linear.E5M2):
            return linear(x, weight, bias)
    state.linear = planted


def _input_scaled_by_weight(state) -> None:
    """fp8-wrong-amax: the input's scale comes from the weight's amax (reduced as the weight's)."""
    linear = state.linear

    def planted(x, weight, bias):
        state.input._scale_for = lambda _x: scale_from_amax(state.weight.amax_of(weight), E4M3,
                                                             state.recipe.margin)
        return linear(x, weight, bias)
    state.linear = planted


class _DividedOnceMore(torch.autograd.Function):
    """Forward: y / s (rounded to y's dtype); backward: the gradient passes to y unchanged, so
    the fault is in the forward GEMM's output alone, as a wrong rescale inside it would be."""
    @staticmethod
    def forward(ctx, y, s):
        return (y.float() / s).to(y.dtype)

    @staticmethod
    def backward(ctx, g):
        return g, None


def _divide_weight_scale_twice(state) -> None:
    """fp8-double-scale: the layer's forward GEMM divides out the weight's scale twice,
    y = (q_x q_w^T) / (s_x s_w^2); the backward's GEMMs stay right."""
    weight_scale_for, linear, used = state.weight._scale_for, state.linear, []

    def recorded(w: torch.Tensor) -> torch.Tensor:
        used.append(weight_scale_for(w))
        return used[-1]

    def planted(x, weight, bias):
        used.clear()
        y = _DividedOnceMore.apply(linear(x, weight, None), used[-1])
        return y + bias if bias is not None else y
    state.weight._scale_for, state.linear = recorded, planted


BLOCK_PLANTS = ("fp8-block-per-tensor", "fp8-mx-scale-not-pow2", "fp8-block-wrong-dim")


def _break_blocks(state, kind: str) -> None:
    """Replace the cast of each of the layer's BlockScalers (fp8_blocks.BlockScaler.quantize):
      fp8-block-per-tensor   one block, the whole local tensor: one scale, 448 / its amax
      fp8-mx-scale-not-pow2  each block's scale max / amax, not the power of two E8M0 holds
      fp8-block-wrong-dim    the input's and gradient's tiles turned: 128 x 1 where the GEMM's
                             K runs along the row (and 1 x 128 where it runs down the column)"""
    for sc in state.scalers():
        if kind == "fp8-block-per-tensor":
            sc.quantize = lambda x, rows, cols, sc=sc: quantize_blocks(x, sc.fmt, *x.shape, False)
        elif kind == "fp8-mx-scale-not-pow2":
            sc.quantize = lambda x, rows, cols, sc=sc: quantize_blocks(x, sc.fmt, rows, cols, False)
        elif sc is not state.weight:
            sc.quantize = lambda x, rows, cols, sc=sc: quantize_blocks(x, sc.fmt, cols, rows, sc.pow2)
