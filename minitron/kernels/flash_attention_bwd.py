"""Flash attention's backward kernels (FlashAttention-2); flash_attention.py launches them.

delta = rowsum(dO * O) first (_bwd_delta). Then a program owning BLOCK_N keys of one kv head
loops over the query heads of its group and all query blocks, summing dK and dV in registers
(the GQA sum needs no atomics: _attn_bwd_dkdv), and a program owning BLOCK_M queries
accumulates dQ (_attn_bwd_dq). Both rebuild every probability as P = exp(s - lse) from the
forward's saved lse instead of storing P.
"""
import triton
import triton.language as tl


@triton.jit
def _bwd_delta(O, DO, DELTA, rows, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    # delta_i = sum_d dO_id * O_id = sum_j P_ij dP_ij: the softmax-backward row term
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = offs[:, None] < rows
    ptrs = offs[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :]
    o = tl.load(O + ptrs, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(DELTA + offs, tl.sum(o * do, axis=1), mask=offs < rows)


@triton.jit
def _bwd_kv_inner(dk, dv, k, v, Q, DO, LSE, DELTA, offs_n, offs_d, lo, hi, sq, qk_scale,
                  MASK_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                  PREC: tl.constexpr):
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < sq
        q = tl.load(Q + offs_m[:, None] * HEAD_DIM + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        do = tl.load(DO + offs_m[:, None] * HEAD_DIM + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        # lse = +inf past the last query makes those P exactly 0
        lse = tl.load(LSE + offs_m, mask=row_ok, other=float("inf")) * 1.4426950408889634
        delta = tl.load(DELTA + offs_m, mask=row_ok, other=0.0)
        # work with transposes ([keys, queries]) so dK, dV come out of plain dots
        pt = tl.exp2(tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale - lse[None, :])
        if MASK_CAUSAL:
            pt = tl.where(offs_m[None, :] >= offs_n[:, None], pt, 0.0)
        dv += tl.dot(pt.to(do.dtype), do, input_precision=PREC)
        dpt = tl.dot(v, tl.trans(do), input_precision=PREC)
        dst = pt * (dpt - delta[None, :])
        dk += tl.dot(dst.to(q.dtype), q, input_precision=PREC)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, HQ, HKV, GROUP, sq, sk, sm_scale, qk_scale,
                   CAUSAL: tl.constexpr, EVEN_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr):
    # all tensors here are contiguous [b, heads, s, d]; key tails are masked on load
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
    b = bhk // HKV
    hk = bhk % HKV
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = offs_n[:, None] < sk
    kv_off = bhk.to(tl.int64) * sk * HEAD_DIM
    k = tl.load(K + kv_off + offs_n[:, None] * HEAD_DIM + offs_d[None, :], mask=col_ok, other=0.0)
    v = tl.load(V + kv_off + offs_n[:, None] * HEAD_DIM + offs_d[None, :], mask=col_ok, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    # queries before this key block cannot see it; the diagonal stretch [lo, mid)
    # needs the mask (BLOCK_N is a multiple of BLOCK_M), the queries after it do not
    if CAUSAL:
        lo = pid_n * BLOCK_N
        mid = lo + BLOCK_N
    else:
        lo = 0
        mid = 0
    for g in range(0, GROUP):  # every query head that reads this kv head
        bh = (b * HQ + hk * GROUP + g).to(tl.int64)
        Qh = Q + bh * sq * HEAD_DIM
        DOh = DO + bh * sq * HEAD_DIM
        LSEh = LSE + bh * sq
        DELTAh = DELTA + bh * sq
        dk, dv = _bwd_kv_inner(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, offs_n, offs_d, lo,
                               tl.minimum(mid, sq), sq, qk_scale, True, HEAD_DIM, BLOCK_M, PREC)
        dk, dv = _bwd_kv_inner(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, offs_n, offs_d, mid, sq, sq,
                               qk_scale, False, HEAD_DIM, BLOCK_M, PREC)
    tl.store(DK + kv_off + offs_n[:, None] * HEAD_DIM + offs_d[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty), mask=col_ok)
    tl.store(DV + kv_off + offs_n[:, None] * HEAD_DIM + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=col_ok)


@triton.jit
def _bwd_q_inner(dq, q, do, lse, delta, K, V, offs_m, offs_d, lo, hi, sk, qk_scale,
                 MASK_CAUSAL: tl.constexpr, EVEN_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_N: tl.constexpr, PREC: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = offs_n[:, None] < sk
        k = tl.load(K + offs_n[:, None] * HEAD_DIM + offs_d[None, :], mask=col_ok, other=0.0)
        v = tl.load(V + offs_n[:, None] * HEAD_DIM + offs_d[None, :], mask=col_ok, other=0.0)
        p = tl.exp2(tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale - lse[:, None])
        if MASK_CAUSAL:
            p = tl.where(offs_m[:, None] >= offs_n[None, :], p, 0.0)
        if not EVEN_N:
            p = tl.where(offs_n[None, :] < sk, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
    return dq


@triton.jit
def _attn_bwd_dq(Q, K, V, DO, LSE, DELTA, DQ, HQ, HKV, GROUP, sq, sk, sm_scale, qk_scale,
                 CAUSAL: tl.constexpr, EVEN_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // HQ
    hk = (bh % HQ) // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < sq
    q_off = bh * sq * HEAD_DIM
    kv_off = (b * HKV + hk) * sk * HEAD_DIM
    q = tl.load(Q + q_off + offs_m[:, None] * HEAD_DIM + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + q_off + offs_m[:, None] * HEAD_DIM + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    lse = tl.load(LSE + bh * sq + offs_m, mask=row_ok, other=float("inf")) * 1.4426950408889634
    delta = tl.load(DELTA + bh * sq + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if CAUSAL:  # as in the forward: unmasked up to the diagonal, masked along it
        diag = tl.minimum(pid_m * BLOCK_M, sk)
        end = tl.minimum(pid_m * BLOCK_M + BLOCK_M, sk)
    else:
        diag = sk
        end = sk
    dq = _bwd_q_inner(dq, q, do, lse, delta, K + kv_off, V + kv_off, offs_m, offs_d, 0, diag, sk,
                      qk_scale, False, EVEN_N, HEAD_DIM, BLOCK_N, PREC)
    dq = _bwd_q_inner(dq, q, do, lse, delta, K + kv_off, V + kv_off, offs_m, offs_d, diag, end, sk,
                      qk_scale, True, EVEN_N, HEAD_DIM, BLOCK_N, PREC)
    tl.store(DQ + q_off + offs_m[:, None] * HEAD_DIM + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])


# The GPU runs the tile autotune picks, per shape, from the lists of attention_configs.py;
# the interpreter one small tile (autotuning there would run every tile, slowly); tests may
# force others with `tiles`.
