"""RMSNorm: y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps), over the last dim.

Forward: one program instance per row; the whole row sits in registers, so x
is read once and y written once, the least traffic the op allows. It saves
only rstd (4 bytes a row): backward re-reads x anyway, so x_hat = x * rstd is
cheaper to recompute than to store.

Backward: dX of a row needs only that row (one pass), but dW sums over all
rows. Each program owns a contiguous chunk of rows, keeps its share of dW in
registers and writes one partial row; a small torch sum over the partials
finishes dW. No atomics, so the result is deterministic.
"""
import torch
import triton
import triton.language as tl

from .common import alloc


@triton.jit
def _rmsnorm_fwd(X, W, Y, RSTD, stride_x, stride_y, N, eps, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    tl.store(RSTD + row, rstd)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rmsnorm_bwd(X, W, DY, DX, RSTD, DW_PART, stride_x, stride_dy, stride_dx, M, N,
                 rows_per_program, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    for i in range(0, rows_per_program):
        row = (pid * rows_per_program + i).to(tl.int64)
        mask = cols < tl.where(row < M, N, 0)  # the last chunk may run past M
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + tl.minimum(row, M - 1))  # in bounds; unused past M
        x_hat = x * rstd
        g = dy * w
        # dx = rstd * (g - x_hat * mean(g * x_hat)): the mean is why a row is one program
        dx = rstd * (g - x_hat * (tl.sum(g * x_hat, axis=0) / N))
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * x_hat
    tl.store(DW_PART + pid * N + cols, dw, mask=col_ok)


def row_launch_config(N, backward=False):
    """Block (the row, padded to a power of two) and warps for a row-per-program
    kernel; a backward holds twice the live rows, so it gets twice the warps
    (fewer registers a thread: no spills, checked with ptxas for sm_90)."""
    block = triton.next_power_of_2(N)
    if block > 32768:
        raise ValueError(f"rows of {N} elements do not fit one program instance")
    return block, min(max(block // (256 if backward else 512), 4), 16)


def backward_programs(M, device):
    """How many programs share the rows in a backward: a few per SM on a GPU
    (enough to fill it, few enough that the partial sums stay small)."""
    if device.type == "cuda":
        target = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        target = 4  # interpreter: few programs, so the row loop gets exercised
    rows_per_program = triton.cdiv(M, min(M, target))
    return triton.cdiv(M, rows_per_program), rows_per_program


def rows_view(t):
    """[..., N] -> [M, N] with unit stride along N (a copy only if needed)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


class RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        x2 = rows_view(x)
        M, N = x2.shape
        weight = weight.contiguous()
        y = alloc((M, N), x.dtype, x.device)
        rstd = alloc((M,), torch.float32, x.device)
        BLOCK_N, warps = row_launch_config(N)
        _rmsnorm_fwd[(M,)](x2, weight, y, rstd, x2.stride(0), y.stride(0), N, eps,
                           BLOCK_N=BLOCK_N, num_warps=warps)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.x_shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        M, N = x2.shape
        dy2 = rows_view(dy)
        dx = alloc((M, N), x2.dtype, x2.device)
        programs, rows_per_program = backward_programs(M, x2.device)
        dw_part = alloc((programs, N), torch.float32, x2.device)
        BLOCK_N, warps = row_launch_config(N, backward=True)
        _rmsnorm_bwd[(programs,)](x2, weight, dy2, dx, rstd, dw_part, x2.stride(0), dy2.stride(0),
                                  dx.stride(0), M, N, rows_per_program, BLOCK_N=BLOCK_N,
                                  num_warps=warps)
        return dx.view(ctx.x_shape), dw_part.sum(0).to(weight.dtype), None
