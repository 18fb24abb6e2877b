"""The noise floor of a low-precision verdict: the one-device run repeated in another order.

In 16 bits or FP8 two correct programs do not agree to the last bit: a split sums a GEMM's
partial products on different ranks, rounds each partial to 16 bits and adds the partials
in 16 bits, where one device rounds once. How far apart correct runs land depends on the
dtype, the model, the tensor: so it is measured, step by step, on the reference itself. The
twin is a copy of the reference (same weights, dropout masks, FP8 scales and histories)
whose every reduction is cut in two halves, each rounded to the dtype, then added:

    mm, addmm, bmm      the contraction dimension (a row-parallel GEMM's K, a weight
                        gradient's sum over tokens, attention's sums over keys and head_dim)
    sum over dims       the first reduced dimension (bias and norm-weight gradients: a data-
                        or sequence-parallel rank's partial sum over its tokens)
    layer norm's dW     its rows in two halves
    embedding's dW      its tokens in two halves
    FP8 GEMMs           K in two halves, each rounded to the activations' dtype (the emulated
                        GEMM accumulates in float32, as a rank's partial of a row-parallel one
                        does before it is rounded and all-reduced in 16 bits)

That is the noise of a 2-way split at every reduction at once, at the same casting points as
the reference: what noise_rows.py holds the split side's errors against.
"""
from __future__ import annotations

import contextlib
import copy
import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
LOW = (torch.bfloat16, torch.float16)


SPLITS = (0.5, 0.3, 0.7, 0.4, 0.6, 0.2)   # where each twin cuts every reduction: six orders


def _parts(n: int, frac: float) -> tuple[slice, slice]:
    k = min(max(1, round(n * frac)), n - 1)
    return slice(0, k), slice(k, n)


# One function per reduction of the module docstring (less the FP8 GEMMs: another_order): the op
# in two rounded parts, or None where it has too few terms to cut (it then runs whole).
def _mm(func, halves, a, b):
    if a.shape[1] < 2:
        return None
    lo, hi = halves(a.shape[1])
    return torch.mm(a[:, lo], b[lo]) + torch.mm(a[:, hi], b[hi])


def _addmm(func, halves, bias, a, b, beta=1, alpha=1):
    out = _mm(func, halves, a, b)
    if out is None:
        return None
    return beta * bias + alpha * out if (beta, alpha) != (1, 1) else bias + out


def _bmm(func, halves, a, b):
    if a.shape[2] < 2:
        return None
    lo, hi = halves(a.shape[2])
    return torch.bmm(a[:, :, lo], b[:, lo]) + torch.bmm(a[:, :, hi], b[:, hi])


def _sum(func, halves, x, dims=None, keepdim=False, dtype=None):
    """Over the first of the reduced dims."""
    if not dims or dtype:
        return None
    dims = [d % x.dim() for d in dims]
    d = dims[0]
    if x.shape[d] < 2:
        return None
    idx = [slice(None)] * x.dim()
    parts = []
    for half in halves(x.shape[d]):
        idx[d] = half
        parts.append(torch.sum(x[tuple(idx)], dims, keepdim=keepdim))
    return parts[0] + parts[1]


def _layer_norm_backward(func, halves, grad, x, shape, mean, rstd, weight, bias, mask):
    """dX whole; dW and db over the rows in two halves, each rounded, then added."""
    h = x.shape[-1]
    if grad.reshape(-1, h).shape[0] < 2:
        return None
    dx = func(grad, x, shape, mean, rstd, weight, bias, [mask[0], False, False])[0]
    g2, x2 = grad.reshape(-1, h), x.reshape(-1, h)
    m2, r2 = mean.reshape(-1, 1), rstd.reshape(-1, 1)
    if not (mask[1] or mask[2]):
        return (dx, *func(grad, x, shape, mean, rstd, weight, bias, [False, mask[1], mask[2]])[1:])
    lo, hi = halves(g2.shape[0])
    a = func(g2[lo], x2[lo], shape, m2[lo], r2[lo], weight, bias, [False, mask[1], mask[2]])
    b = func(g2[hi], x2[hi], shape, m2[hi], r2[hi], weight, bias, [False, mask[1], mask[2]])
    dw = a[1] + b[1] if mask[1] else None
    db = a[2] + b[2] if mask[2] else None
    return dx, dw, db


def _embedding_backward(func, halves, grad, indices, rows, pad, sparse):
    """Over the tokens."""
    g, i = grad.reshape(-1, grad.shape[-1]), indices.reshape(-1)
    if i.numel() < 2:
        return None
    lo, hi = halves(i.numel())
    return func(g[lo], i[lo], rows, pad, sparse) + func(g[hi], i[hi], rows, pad, sparse)


CUTS = {aten.mm.default: _mm, aten.addmm.default: _addmm, aten.bmm.default: _bmm,
        aten.sum.dim_IntList: _sum, aten.native_layer_norm_backward.default: _layer_norm_backward,
        aten.embedding_dense_backward.default: _embedding_backward}


class SplitReductions(TorchDispatchMode):
    """Inside it, the reductions of the module docstring (CUTS) run as two rounded parts, the
    first `frac` of the terms and the rest."""

    def __init__(self, frac: float = 0.5):
        super().__init__()
        self.frac = frac

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in a frame that turns dynamo off, a cost on
        # every op; nothing under this mode is ever compiled
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        cut = CUTS.get(func)                 # most ops are no reduction: as they are, at once
        if cut is not None and _first_tensor_dtype(args) in LOW:
            out = cut(func, functools.partial(_parts, frac=self.frac), *args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


def _first_tensor_dtype(args) -> torch.dtype | None:
    return next((a.dtype for a in args if isinstance(a, torch.Tensor)), None)


def _split_scaled_matmul(real, frac: float):
    """fp8_linear.scaled_matmul with K in two halves, each rounded to out_dtype, then added."""
    def split(a, a_scale, b, b_scale, out_dtype):
        if a.shape[1] < 2 or out_dtype not in LOW:
            return real(a, a_scale, b, b_scale, out_dtype)
        lo, hi = _parts(a.shape[1], frac)
        return real(a[:, lo], a_scale, b[lo], b_scale, out_dtype) + \
            real(a[:, hi], a_scale, b[hi], b_scale, out_dtype)
    return split


@contextlib.contextmanager
def another_order(frac: float = 0.5):
    """Inside the block every reduction of the module docstring is cut in two parts."""
    from ..tensor_parallel import fp8_linear
    real = fp8_linear.scaled_matmul
    fp8_linear.scaled_matmul = _split_scaled_matmul(real, frac)
    try:
        with SplitReductions(frac):
            yield
    finally:
        fp8_linear.scaled_matmul = real


def twin(ref) -> torch.nn.Module:
    """A copy of the reference GPT as it is now: weights, dropout stream, FP8 histories and
    scales; no gradients (built anew: a module holding the last forward's graph cannot be
    deep-copied)."""
    from ..model.reference import GPT
    from ..tensor_parallel.fp8_linear import fp8_state_dict, load_fp8_state_dict, named_fp8_states
    p = next(ref.parameters())
    out = GPT(ref.cfg).to(device=p.device, dtype=p.dtype)
    out.load_state_dict(ref.state_dict())
    out.rng = copy.deepcopy(ref.rng)
    states = named_fp8_states(ref)
    if states:
        out.enable_fp8(next(iter(states.values())).recipe)
        load_fp8_state_dict(out, fp8_state_dict(ref))
    return out


__all__ = ["SPLITS", "SplitReductions", "another_order", "twin"]
