"""Fused AdamW step: one pass over the fp32 master weights.

torch.optim.AdamW (fused=False) makes a separate pass over memory for each of
decay, exp_avg, exp_avg_sq, sqrt, divide and update; here each program
instance owns BLOCK consecutive elements and does the whole step on them in
registers: read p, g, m, v once, write p, m, v (and the low-precision model
copy) once. Memory traffic is the whole cost of an optimizer step, so that is
the whole speedup.

The arithmetic follows torch's single-tensor AdamW operation by operation, in
the same order, so results agree to float32 rounding:
    p *= 1 - lr * wd                     (decoupled weight decay, first)
    m  = lerp(m, g, 1 - beta1)
    v  = v * beta2 + (1 - beta2) * g * g
    p -= step_size * m / (sqrt(v) / sqrt(bc2) + eps),  step_size = lr / bc1
Scalars that depend on the step are computed on the host in float64, as
torch does, and reach the kernel as fp32, as torch's scalar arguments do.
"""
import triton
import triton.language as tl


@triton.jit
def _adamw_kernel(P, G, M, V, OUT, n, decay, w1, beta2, one_minus_beta2, eps, step_size, bc2_sqrt,
                  LERP_FROM_END: tl.constexpr, HAS_OUT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(P + offs, mask=mask)
    g = tl.load(G + offs, mask=mask).to(tl.float32)
    m = tl.load(M + offs, mask=mask)
    v = tl.load(V + offs, mask=mask)
    p = p * decay
    # torch.lerp's two formulas (it picks by the weight, for accuracy)
    if LERP_FROM_END:
        m = tl.fma(-(g - m), 1 - w1, g)
    else:
        m = tl.fma(w1, g - m, m)
    v = tl.fma(one_minus_beta2 * g, g, v * beta2)
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps  # IEEE-rounded, like torch's
    p = p + tl.div_rn(-step_size * m, denom)  # addcdiv: (value * t1) / t2
    tl.store(P + offs, p, mask=mask)
    tl.store(M + offs, m, mask=mask)
    tl.store(V + offs, v, mask=mask)
    if HAS_OUT:
        tl.store(OUT + offs, p.to(OUT.dtype.element_ty), mask=mask)


def adamw_step(param, grad, exp_avg, exp_avg_sq, model_param, *, lr, beta1, beta2, eps,
               weight_decay, step_size, bc2_sqrt):
    for name, t in (("param", param), ("grad", grad), ("exp_avg", exp_avg),
                    ("exp_avg_sq", exp_avg_sq), ("model_param", model_param)):
        if t is not None and (not t.is_contiguous() or t.numel() != param.numel()):
            raise ValueError(f"{name} must be contiguous with param's {param.numel()} elements")
    n = param.numel()
    BLOCK = 1024
    w1 = 1 - beta1
    _adamw_kernel[(triton.cdiv(n, BLOCK),)](
        param, grad, exp_avg, exp_avg_sq, param if model_param is None else model_param, n,
        1 - lr * weight_decay, w1, beta2, 1 - beta2, eps, step_size, bc2_sqrt,
        LERP_FROM_END=abs(w1) >= 0.5, HAS_OUT=model_param is not None, BLOCK=BLOCK,
        enable_fp_fusion=False)  # torch rounds after every op; tl.fma marks where it does not
