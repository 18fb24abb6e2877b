"""The MLP's elementwise middles, each fused into one read and one write.

SwiGLU: out = silu(gate) * up. Unfused, torch runs silu (read gate, write a
temporary) and then the product (read both, write out); fused it is read
gate and up once, write out once. Backward, with s = sigmoid(gate):
d gate = dout * up * s * (1 + gate * (1 - s)),  d up = dout * silu(gate).

Bias-GeLU: out = gelu(x + b), Megatron's fusion of the first MLP matmul's
bias add with the activation. 'none' is the exact GeLU x * Phi(x) with the
erf (what torch.nn.functional.gelu does by default), 'tanh' the tanh
approximation. Backward recomputes x + b rather than saving it.

Both kernels treat tensors as [rows, F] with a row stride, so gate and up may
be the two halves of one [.., 2F] projection output without a copy; a
program instance owns one BLOCK-wide stretch of one row.
"""
import torch
import triton
import triton.language as tl

from .common import alloc
from .rmsnorm import rows_view

# The kernels write their constants out (a jitted kernel reads no plain Python global):
# 0.7978845608028654 = sqrt(2/pi), 0.7071067811865476 = 1/sqrt(2), 0.3989422804014327 = 1/sqrt(2 pi).


@triton.jit
def _swiglu_fwd(G, U, O, stride_g, stride_u, F, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(O + row * F + cols, (g * tl.sigmoid(g) * u).to(O.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(G, U, DO, DG, DU, stride_g, stride_u, F, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + row * F + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    tl.store(DG + row * F + cols, (do * u * s * (1 + g * (1 - s))).to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + row * F + cols, (do * g * s).to(DU.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_and_grad(z, TANH: tl.constexpr):
    """gelu(z) and gelu'(z), fp32."""
    if TANH:
        k = 0.7978845608028654 * (z + 0.044715 * z * z * z)
        t = 2 * tl.sigmoid(2 * k) - 1  # tanh(k), from what every Triton version has
        y = 0.5 * z * (1 + t)
        dy = 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * 0.7978845608028654 * (1 + 3 * 0.044715 * z * z)
    else:
        cdf = 0.5 * (1 + tl.erf(z * 0.7071067811865476))
        y = z * cdf
        dy = cdf + z * 0.3989422804014327 * tl.exp(-0.5 * z * z)
    return y, dy


@triton.jit
def _bias_gelu_fwd(X, B, O, stride_x, F, TANH: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    z = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    z += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    y, _ = _gelu_and_grad(z, TANH)
    tl.store(O + row * F + cols, y.to(O.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_bwd(X, B, DO, DX, stride_x, F, TANH: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    z = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    z += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    _, dy = _gelu_and_grad(z, TANH)
    do = tl.load(DO + row * F + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(DX + row * F + cols, (do * dy).to(DX.dtype.element_ty), mask=mask)


def _grid(M, F):
    block = min(triton.next_power_of_2(F), 1024)
    return (M, triton.cdiv(F, block)), block


class SwiGLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        if gate.shape != up.shape:
            raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
        g2, u2 = rows_view(gate), rows_view(up)
        M, F = g2.shape
        out = alloc((M, F), gate.dtype, gate.device)
        grid, block = _grid(M, F)
        _swiglu_fwd[grid](g2, u2, out, g2.stride(0), u2.stride(0), F, BLOCK=block)
        ctx.save_for_backward(g2, u2)
        ctx.shape, ctx.up_dtype = gate.shape, up.dtype
        return out.view(gate.shape)

    @staticmethod
    def backward(ctx, dout):
        g2, u2 = ctx.saved_tensors
        M, F = g2.shape
        do = dout.reshape(M, F).contiguous()
        dg, du = alloc((M, F), g2.dtype, g2.device), alloc((M, F), ctx.up_dtype, g2.device)
        grid, block = _grid(M, F)
        _swiglu_bwd[grid](g2, u2, do, dg, du, g2.stride(0), u2.stride(0), F, BLOCK=block)
        return dg.view(ctx.shape), du.view(ctx.shape)


class BiasGeLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, approximate):
        x2 = rows_view(x)
        M, F = x2.shape
        bias = bias.contiguous()
        out = alloc((M, F), x.dtype, x.device)
        grid, block = _grid(M, F)
        tanh = approximate == "tanh"
        _bias_gelu_fwd[grid](x2, bias, out, x2.stride(0), F, TANH=tanh, BLOCK=block)
        ctx.save_for_backward(x2, bias)
        ctx.shape, ctx.tanh = x.shape, tanh
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, dout):
        x2, bias = ctx.saved_tensors
        M, F = x2.shape
        do = dout.reshape(M, F).contiguous()
        dx = alloc((M, F), x2.dtype, x2.device)
        grid, block = _grid(M, F)
        _bias_gelu_bwd[grid](x2, bias, do, dx, x2.stride(0), F, TANH=ctx.tanh, BLOCK=block)
        # d bias = column sums of d(x + b): a reduction over rows, left to torch (in fp32)
        dbias = dx.sum(0, dtype=torch.float32).to(bias.dtype)
        return dx.view(ctx.shape), dbias, None
