"""Scaled, optionally causal softmax over the last dim of [b, h, sq, sk] scores:
Megatron's fused softmax for attention that is not flash attention.

One program instance owns one row (one query of one head): scale, mask, max,
exp, sum and normalise all happen in registers, so the scores are read once
and the probabilities written once, where eager torch would make a pass for
the scale, one for the mask and several for the softmax.

Causal: query i sees keys j <= i, both counted from 0. Masked entries come out
exactly 0. Backward needs the output y (not the input):
dx = scale * y * (dy - sum(dy * y)), again one row per program.
"""
import torch
import triton
import triton.language as tl

from .common import alloc
from .rmsnorm import row_launch_config


@triton.jit
def _softmax_fwd(X, Y, sq, sk, scale, CAUSAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    keep = cols < sk
    if CAUSAL:
        keep = keep & (cols <= row % sq)  # row % sq is this row's query index
    x = tl.load(X + row * sk + cols, mask=keep, other=float("-inf")).to(tl.float32)
    x = x * scale
    # subtract the row max before exp: same result, no overflow; key 0 is never
    # masked, so the max is finite
    e = tl.exp(x - tl.max(x, axis=0))
    y = e / tl.sum(e, axis=0)
    tl.store(Y + row * sk + cols, y.to(Y.dtype.element_ty), mask=cols < sk)


@triton.jit
def _softmax_bwd(Y, DY, DX, sk, scale, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < sk
    y = tl.load(Y + row * sk + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * sk + cols, mask=mask, other=0.0).to(tl.float32)
    dx = scale * y * (dy - tl.sum(dy * y, axis=0))
    tl.store(DX + row * sk + cols, dx.to(DX.dtype.element_ty), mask=mask)


class ScaledMaskedSoftmaxFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores, scale, causal):
        x = scores.contiguous()
        sq, sk = x.shape[-2:]
        rows = x.numel() // sk
        y = alloc(x.shape, x.dtype, x.device)
        BLOCK, warps = row_launch_config(sk)
        _softmax_fwd[(rows,)](x, y, sq, sk, float(scale), CAUSAL=bool(causal), BLOCK=BLOCK,
                              num_warps=warps)
        ctx.save_for_backward(y)
        ctx.scale = float(scale)
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        dy = dy.contiguous()
        sk = y.shape[-1]
        dx = alloc(y.shape, y.dtype, y.device)
        BLOCK, warps = row_launch_config(sk)
        _softmax_bwd[(y.numel() // sk,)](y, dy, dx, sk, ctx.scale, BLOCK=BLOCK, num_warps=warps)
        return dx, None, None
