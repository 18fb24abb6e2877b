"""LayerNorm: y = (x - mean) * rstd * w + b over the last dim.

Same plan as rmsnorm.py: forward is one program per row and saves only the two
per-row statistics (mean, rstd: 8 bytes a row) instead of the normalised x;
backward computes dX row by row and dW, dB as per-program partial sums that a
small torch sum finishes.
"""
import torch
import triton
import triton.language as tl

from .common import alloc
from .rmsnorm import backward_programs, row_launch_config, rows_view


@triton.jit
def _layernorm_fwd(X, W, B, Y, MEAN, RSTD, stride_x, stride_y, N, eps, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / N
    # two passes over registers (mean, then variance of x - mean): no cancellation
    xc = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / N + eps)
    tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (xc * rstd * w + b).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _layernorm_bwd(X, W, DY, DX, MEAN, RSTD, DW_PART, DB_PART, stride_x, stride_dy, stride_dx,
                   M, N, rows_per_program, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    for i in range(0, rows_per_program):
        row = (pid * rows_per_program + i).to(tl.int64)
        mask = cols < tl.where(row < M, N, 0)  # the last chunk may run past M
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + tl.minimum(row, M - 1))  # in bounds; unused past M
        rstd = tl.load(RSTD + tl.minimum(row, M - 1))
        x_hat = tl.where(mask, (x - mean) * rstd, 0.0)
        g = dy * w
        # dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat))
        dx = rstd * (g - tl.sum(g, axis=0) / N - x_hat * (tl.sum(g * x_hat, axis=0) / N))
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * x_hat
        db += dy
    tl.store(DW_PART + pid * N + cols, dw, mask=col_ok)
    tl.store(DB_PART + pid * N + cols, db, mask=col_ok)


class LayerNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        x2 = rows_view(x)
        M, N = x2.shape
        weight, bias = weight.contiguous(), bias.contiguous()
        y = alloc((M, N), x.dtype, x.device)
        mean = alloc((M,), torch.float32, x.device)
        rstd = alloc((M,), torch.float32, x.device)
        BLOCK_N, warps = row_launch_config(N)
        _layernorm_fwd[(M,)](x2, weight, bias, y, mean, rstd, x2.stride(0), y.stride(0), N, eps,
                             BLOCK_N=BLOCK_N, num_warps=warps)
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.x_shape, ctx.bias_dtype = x.shape, bias.dtype
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, mean, rstd = ctx.saved_tensors
        M, N = x2.shape
        dy2 = rows_view(dy)
        dx = alloc((M, N), x2.dtype, x2.device)
        programs, rows_per_program = backward_programs(M, x2.device)
        dw_part = alloc((programs, N), torch.float32, x2.device)
        db_part = alloc((programs, N), torch.float32, x2.device)
        BLOCK_N, warps = row_launch_config(N, backward=True)
        _layernorm_bwd[(programs,)](x2, weight, dy2, dx, mean, rstd, dw_part, db_part,
                                    x2.stride(0), dy2.stride(0), dx.stride(0), M, N,
                                    rows_per_program, BLOCK_N=BLOCK_N, num_warps=warps)
        dw = dw_part.sum(0).to(weight.dtype)
        db = db_part.sum(0).to(ctx.bias_dtype)
        return dx.view(ctx.x_shape), dw, db, None
