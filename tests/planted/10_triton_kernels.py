"""Planted wrong answer for exercises/10_triton_kernels.ipynb (provisional, written against the
solution of 30 Nov 2026): the mean of squares divides by the padded block BLOCK_N instead of the
row length N. Right whenever N is a power of two, wrong for Check 1's 97-element rows."""

WRONG = {
    "b2d5eb57": '''@triton.jit
def rmsnorm_fwd(X, W, Y, RSTD, stride_x, stride_y, N, eps, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / BLOCK_N + eps)   # wrong: the padded length
    tl.store(RSTD + row, rstd)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)
''',
}

FAILS_AT = "Check 1"
