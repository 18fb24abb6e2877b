"""Attention on one block of keys, and the exact merge of partial results.

A rank never sees all keys at once (ring), or sees them as separate chunks (all-gather), so
attention is computed block by block. For query i and a block B of keys, the block returns

    lse_B(i) = log sum_{j in B} exp(s_ij)          s_ij = q_i . k_j * scale
    out_B(i) = sum_{j in B} exp(s_ij - lse_B(i)) v_j      (softmax within the block)

and two blocks merge exactly (online softmax, with log-sum-exps instead of max and sum):

    lse = log(exp(lse_A) + exp(lse_B))       (torch.logaddexp: no overflow)
    out = exp(lse_A - lse) out_A + exp(lse_B - lse) out_B

since exp(lse_A - lse) is exactly the share of the softmax mass block A holds.

Backward needs no merge: with the final out O and lse L of each query, every block's share
of the gradient is computed alone from P_ij = exp(s_ij - L_i) (the *global* probability)
and delta_i = dO_i . O_i, which is exactly what a flash-attention backward kernel does when
handed the global O and L instead of the block's own. So dQ is a sum over blocks, and dK, dV
of a block need only that block's keys: they can travel back to their owner.

Dropout (the reference's exact masks): `drop` holds keep/(1-p) for this block's (query, key)
pairs and multiplies the probabilities after the softmax, as the reference does; the
log-sum-exp (the softmax's normaliser) is not dropped.

Two implementations of one block: plain torch (float32, or float64 for float64 inputs) and
minitron's flash-attention kernel (kernels/flash_attention.py; it returns the lse). The
kernel applies no dropout mask, so a block with `drop` always runs in torch.
"""
from __future__ import annotations

import torch


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float64 else t.float()


def _expand_kv(t: torch.Tensor, group: int) -> torch.Tensor:
    """Grouped-query attention: query head h reads kv head h // group."""
    return t.repeat_interleave(group, dim=1) if group > 1 else t


def _scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    s = _wide(q) @ _expand_kv(_wide(k), q.shape[1] // k.shape[1]).transpose(-1, -2) * scale
    if causal:   # chunks on the diagonal: query i of the chunk sees its keys j <= i
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return s


def torch_forward(q, k, v, causal: bool, scale: float, drop=None):
    """(out_B, lse_B) of one block, out in the wide dtype; q [b, hq, m, d], k/v [b, hkv, n, d]."""
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    if drop is not None:
        p = p * drop
    return p @ _expand_kv(_wide(v), q.shape[1] // k.shape[1]), lse


def _sum_groups(t: torch.Tensor, hkv: int) -> torch.Tensor:
    """[b, hq, n, d] -> [b, hkv, n, d]: a kv head's gradient sums over the heads reading it."""
    b, hq, n, d = t.shape
    return t.reshape(b, hkv, hq // hkv, n, d).sum(2) if hq != hkv else t


def torch_backward(do, q, k, v, lse, delta, causal: bool, scale: float, drop=None):
    """This block's (dq, dk, dv), wide, given the *global* lse and delta = rowsum(dO * O)."""
    group, hkv = q.shape[1] // k.shape[1], k.shape[1]
    p = torch.exp(_scores(q, k, causal, scale) - lse[..., None])   # masked scores -> 0
    do = _wide(do)
    vf = _expand_kv(_wide(v), group)
    pd = p if drop is None else p * drop
    dv = pd.transpose(-1, -2) @ do
    dp = do @ vf.transpose(-1, -2)
    if drop is not None:
        dp = dp * drop
    ds = p * (dp - delta[..., None])
    dq = ds @ _expand_kv(_wide(k), group) * scale
    dk = ds.transpose(-1, -2) @ _wide(q) * scale
    return dq, _sum_groups(dk, hkv), _sum_groups(dv, hkv)


def kernel_forward(q, k, v, causal: bool, scale: float):
    from ..kernels.flash_attention import attention_forward
    out, lse = attention_forward(q, k, v, causal, scale)
    return _wide(out), lse


def kernel_backward(do, q, k, v, out, lse, causal: bool, scale: float):
    """The kernel computes delta itself from the global out it is given."""
    from ..kernels.flash_attention import attention_backward
    grads = attention_backward(do, q, k, v, out, lse.contiguous(), causal, scale)
    return tuple(_wide(t) for t in grads)


class Accumulator:
    """The running (out, lse) of this rank's queries, merged block by block (online softmax)."""

    def __init__(self, q: torch.Tensor):
        b, h, m, d = q.shape
        dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        self.out = torch.zeros(b, h, m, d, dtype=dtype, device=q.device)
        self.lse = torch.full((b, h, m), float("-inf"), dtype=dtype, device=q.device)

    def merge(self, rows: slice, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
        out, lse = self.out[:, :, rows], self.lse[:, :, rows]
        new = torch.logaddexp(lse, lse_b.to(lse.dtype))
        out.copy_(torch.exp(lse - new)[..., None] * out + torch.exp(lse_b - new)[..., None] * out_b)
        lse.copy_(new)


def block_pairs(q_chunks, k_chunks, c: int, causal: bool):
    """(query rows, key columns, causal?) of every block with work, in local index slices.

    Query chunk a sees key chunk b whole when a > b, through the causal diagonal when a == b,
    not at all when a < b. Pairs are coalesced so that a ring step is one block: a rank's own
    (increasing) chunks against themselves are exactly one causal mask over the concatenation
    (the early chunk never sees the late one, the late one sees all of the early one); against
    another rank's chunks every pair is whole or empty, and the whole ones form one rectangle
    (zigzag: all queries against the early chunk, or the late queries against all keys)."""
    rows, cols = slice(0, c * len(q_chunks)), slice(0, c * len(k_chunks))
    if not causal:
        return [(rows, cols, False)]
    if list(q_chunks) == list(k_chunks) == sorted(k_chunks):
        return [(rows, cols, True)]
    blocks = []
    for i, a in enumerate(q_chunks):
        seen = [j for j, b in enumerate(k_chunks) if a >= b]
        for j in seen:
            diag = a == k_chunks[j]
            span = (j, j + 1)
            if not diag and blocks and not blocks[-1][2] and blocks[-1][0] == (i, i + 1) \
                    and blocks[-1][1][1] == j:
                span = (blocks.pop()[1][0], j + 1)                # extend along the keys
            blocks.append(((i, i + 1), span, diag))
    merged = []
    for r, k, diag in blocks:                                     # then along the queries
        if merged and not diag and not merged[-1][2] and merged[-1][1] == k and merged[-1][0][1] == r[0]:
            r = (merged.pop()[0][0], r[1])
        merged.append((r, k, diag))
    return [(slice(r[0] * c, r[1] * c), slice(k[0] * c, k[1] * c), diag) for r, k, diag in merged]


class BlockMath:
    """How each block is computed: torch or the flash kernel, with or without dropout."""

    def __init__(self, scale: float, use_kernels: bool, drop=None):
        self.scale, self.drop = scale, drop
        self.kernel = use_kernels and drop is None

    def _drop(self, q_pos, k_pos):
        return None if self.drop is None else self.drop[:, :, q_pos][:, :, :, k_pos]

    def forward(self, q, k, v, causal, q_pos, k_pos):
        if self.kernel:
            return kernel_forward(q, k, v, causal, self.scale)
        return torch_forward(q, k, v, causal, self.scale, self._drop(q_pos, k_pos))

    def backward(self, do, q, k, v, out, lse, delta, causal, q_pos, k_pos):
        if self.kernel:
            return kernel_backward(do, q, k, v, out, lse, causal, self.scale)
        return torch_backward(do, q, k, v, lse, delta, causal, self.scale, self._drop(q_pos, k_pos))
