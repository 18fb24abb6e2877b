"""Flash attention: softmax(q k^T * scale) v without ever storing the [sq, sk]
scores, with grouped-query attention and an optional causal mask (query i
sees keys j <= i, both indexed from 0).

Forward: a program instance owns BLOCK_M queries of one (batch, query head)
and walks over the keys BLOCK_N at a time, keeping per query the running max
m, the running sum l of exp(s - m) and the unnormalised output acc. When a
block raises the max, what was summed so far is scaled by exp(m_old - m_new)
(the online-softmax rescale). At the end out = acc / l, and lse = m + log(l)
is saved: 4 bytes a query, from which backward rebuilds every probability as
P = exp(s - lse) instead of storing P. exp2 with log2(e) folded into the scale
saves a multiply per score.

Backward (FlashAttention-2): delta = rowsum(dO * O); then a program owning
BLOCK_N keys of one kv head loops over the query heads of its group and all
query blocks, summing dK, dV in registers (the GQA sum needs no atomics); and
a program owning BLOCK_M queries accumulates dQ. Both recompute P from lse
(flash_attention_bwd.py holds those kernels).
"""
import torch
import triton
import triton.language as tl

from .attention_configs import CONFIGS
from .common import alloc, interpreting
from .flash_attention_bwd import _attn_bwd_dkdv, _attn_bwd_dq, _bwd_delta

LOG2E = 1.4426950408889634


@triton.jit
def _fwd_inner(acc, m_i, l_i, q, K, V, stride_kn, stride_vn, offs_m, offs_d, lo, hi, sk, qk_scale,
               MASK_CAUSAL: tl.constexpr, EVEN_N: tl.constexpr, BLOCK_N: tl.constexpr,
               PREC: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        rows = offs_n.to(tl.int64)  # key * stride passes 2**31 at s = 512K, 32 heads of 128 ([b, s, h, d])
        kt_ptrs = K + rows[None, :] * stride_kn + offs_d[:, None]  # k loaded transposed: [D, N]
        v_ptrs = V + rows[:, None] * stride_vn + offs_d[None, :]
        if EVEN_N:
            kt = tl.load(kt_ptrs)
            v = tl.load(v_ptrs)
        else:
            kt = tl.load(kt_ptrs, mask=offs_n[None, :] < sk, other=0.0)
            v = tl.load(v_ptrs, mask=offs_n[:, None] < sk, other=0.0)
        s = tl.dot(q, kt, input_precision=PREC) * qk_scale  # log2 units
        if MASK_CAUSAL:
            s = tl.where(offs_m[:, None] >= offs_n[None, :], s, float("-inf"))
        if not EVEN_N:
            s = tl.where(offs_n[None, :] < sk, s, float("-inf"))
        # every row already saw key 0 in the first block, so m_new is finite
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)  # rescale of what was summed against the old max
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PREC)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attn_fwd(Q, K, V, O, LSE, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som,
              HQ, GROUP, sq, sk, qk_scale, CAUSAL: tl.constexpr, EVEN_N: tl.constexpr,
              HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              PREC: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HQ
    h = bh % HQ
    hk = h // GROUP  # grouped-query attention: this head's kv head
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    # 64-bit offsets wherever a product can pass 2**31 (32 heads x 512K x 128 does): head or
    # batch times its stride, query index times the row stride
    b64, h64, hk64, rows = b.to(tl.int64), h.to(tl.int64), hk.to(tl.int64), offs_m.to(tl.int64)
    Q += b64 * sqb + h64 * sqh
    K += b64 * skb + hk64 * skh
    V += b64 * svb + hk64 * svh
    q = tl.load(Q + rows[:, None] * sqm + offs_d[None, :], mask=offs_m[:, None] < sq, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # keys below the block's first query are visible to all its rows: no mask; only
    # the diagonal stretch [diag, end) needs one (BLOCK_M is a multiple of BLOCK_N)
    if CAUSAL:
        diag = tl.minimum(pid_m * BLOCK_M, sk)
        end = tl.minimum(pid_m * BLOCK_M + BLOCK_M, sk)
    else:
        diag = sk
        end = sk
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, K, V, skn, svn, offs_m, offs_d, 0, diag, sk,
                               qk_scale, False, EVEN_N, BLOCK_N, PREC)
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, K, V, skn, svn, offs_m, offs_d, diag, end, sk,
                               qk_scale, True, EVEN_N, BLOCK_N, PREC)
    row_ok = offs_m < sq
    O += b64 * sob + h64 * soh
    tl.store(O + rows[:, None] * som + offs_d[None, :], (acc / l_i[:, None]).to(O.dtype.element_ty),
             mask=row_ok[:, None])
    lse = (m_i + tl.log2(l_i)) / 1.4426950408889634  # back to natural log
    tl.store(LSE + bh.to(tl.int64) * sq + offs_m, lse, mask=row_ok)


_KERNELS = {"fwd": _attn_fwd, "dkdv": _attn_bwd_dkdv, "dq": _attn_bwd_dq}
_KEY = ["sq", "sk", "HEAD_DIM", "CAUSAL"]
_TUNED = {key: triton.autotune([triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
                                for m, n, w, s in table], key=_KEY)(_KERNELS[key[0]])
          for key, table in CONFIGS.items()}
_fwd_tuned = _TUNED["fwd", "16bit"]  # lesson 10 shows the tile it picked for its bf16 run
INTERPRETER_TILE = (16, 16)
_FORCED = {}      # kernel -> (BLOCK_M, BLOCK_N) inside a `tiles` block
last_launch = {}  # kernel -> BLOCK_M, BLOCK_N and EVEN_N of its latest launch: what tests check


class tiles:
    """``with tiles(fwd=(32, 16), dkdv=(16, 32), dq=(32, 16)): ...`` runs these tiles instead
    of autotune's (GPU) or INTERPRETER_TILE: how tests reach rectangular tiles on the causal
    diagonal, or a GPU's tile sizes in the interpreter."""

    def __init__(self, **blocks):
        for kernel, (bm, bn) in blocks.items():
            if kernel not in _KERNELS:
                raise ValueError(f"tiles: the kernels are {sorted(_KERNELS)}, got {kernel!r}")
            if any(n < 16 or n & (n - 1) for n in (bm, bn)):
                raise ValueError(f"tiles: {kernel} blocks must be powers of two >= 16, got {bm} x {bn}")
            if (bn % bm if kernel == "dkdv" else bm % bn):
                need = "BLOCK_N a multiple of BLOCK_M" if kernel == "dkdv" else "BLOCK_M a multiple of BLOCK_N"
                raise ValueError(f"tiles: {kernel} needs {need}, got {bm} x {bn}")
        self.blocks = blocks

    def __enter__(self):
        self.previous = dict(_FORCED)
        _FORCED.update(self.blocks)
        return self

    def __exit__(self, *exc):
        _FORCED.clear()
        _FORCED.update(self.previous)


def _launch(kernel, q, grid, *args, sk, **flags):
    """Run one of the three kernels. EVEN_N (no key tail to mask) must hold for the BLOCK_N
    that runs: for autotune, for every BLOCK_N it may pick."""
    blocks = _FORCED.get(kernel) or (INTERPRETER_TILE if interpreting() else None)
    if blocks:
        meta = {"BLOCK_M": blocks[0], "BLOCK_N": blocks[1]}
        even = sk % blocks[1] == 0
        _KERNELS[kernel][grid(meta)](*args, **flags, EVEN_N=even, **meta)
    else:
        tuned = _TUNED[kernel, "fp32" if q.dtype == torch.float32 else "16bit"]
        even = all(sk % c.kwargs["BLOCK_N"] == 0 for c in tuned.configs)
        tuned[grid](*args, **flags, EVEN_N=even)
        meta = tuned.best_config.kwargs
    last_launch[kernel] = {"BLOCK_M": meta["BLOCK_M"], "BLOCK_N": meta["BLOCK_N"], "EVEN_N": even}


def _flags(q, causal):
    return dict(CAUSAL=bool(causal), HEAD_DIM=q.shape[-1],
                PREC="ieee" if q.dtype == torch.float32 else "tf32")  # tf32: ignored for 16-bit


def attention_forward(q, k, v, causal, scale):
    """(out, lse) for q [b, hq, sq, d], k/v [b, hkv, sk, d]; no autograd."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    if hq % hkv or d not in (16, 32, 64, 128, 256) or v.shape != k.shape or k.shape[0] != b \
            or not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"unsupported shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    o = alloc((b, hq, sq, d), q.dtype, q.device)
    lse = alloc((b, hq, sq), torch.float32, q.device)
    _launch("fwd", q, lambda meta: (triton.cdiv(sq, meta["BLOCK_M"]), b * hq),
            q, k, v, o, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
            hq, hq // hkv, sq, sk, scale * LOG2E, sk=sk, **_flags(q, causal))
    return o, lse


def attention_backward(do, q, k, v, o, lse, causal, scale, dlse=None):
    """(dq, dk, dv) given the forward's o and lse; dlse, if given, is the
    gradient reaching lse (ring attention merges partials through it):
    d lse_i / d s_ij = P_ij, so it only shifts delta."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    do = do.to(q.dtype)
    q, k, v, o, do = (t.contiguous() for t in (q, k, v, o, do))  # dense [b, h, s, d] from here
    delta = alloc((b, hq, sq), torch.float32, q.device)
    rows = b * hq * sq
    block = 4096 // d
    _bwd_delta[(triton.cdiv(rows, block),)](o, do, delta, rows, HEAD_DIM=d, BLOCK=block)
    if dlse is not None:
        delta -= dlse
    dq = alloc(q.shape, q.dtype, q.device)
    dk, dv = alloc(k.shape, k.dtype, k.device), alloc(v.shape, v.dtype, v.device)
    args = (q, k, v, do, lse, delta)
    sizes = (hq, hkv, hq // hkv, sq, sk, scale, scale * LOG2E)
    flags = _flags(q, causal)
    _launch("dkdv", q, lambda meta: (triton.cdiv(sk, meta["BLOCK_N"]), b * hkv),
            *args, dk, dv, *sizes, sk=sk, **flags)
    _launch("dq", q, lambda meta: (triton.cdiv(sq, meta["BLOCK_M"]), b * hq),
            *args, dq, *sizes, sk=sk, **flags)
    return dq, dk, dv


class FlashAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        o, lse = attention_forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        ctx.set_materialize_grads(False)  # an unused lse then brings None, not zeros
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        do = torch.zeros_like(o) if do is None else do
        return (*attention_backward(do, q, k, v, o, lse, ctx.causal, ctx.scale, dlse), None, None)
