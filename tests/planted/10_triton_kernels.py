"""Planted wrong answer for exercises/10_triton_kernels.ipynb: the online softmax of the lesson's
kernel, transcribed without the guard for a query that has seen no visible key yet. In the
natural order every causal row sees key 0 first and the result is right; in the reversed and
shuffled orders the first block is fully masked for some queries, m stays -inf, and
exp(-inf - (-inf)) = NaN spreads through those rows. The Triton kernels of Part 1 are the
solution's, so Check 3 is the first check that fails."""

WRONG = {
    "1c5465b9": '''def attention_by_key_blocks(q, k, v, causal: bool, order, block_n: int):
    "Returns (o, lse): attention over the key blocks in `order`, one block at a time."
    s, d = q.shape[-2], q.shape[-1]
    qf = q.float() / math.sqrt(d)
    m = torch.full(q.shape[:-1], -math.inf)
    l = torch.zeros(q.shape[:-1])
    acc = torch.zeros(q.shape, dtype=torch.float32)
    rows = torch.arange(s)[:, None]
    for blk in order:
        lo, hi = blk * block_n, min((blk + 1) * block_n, k.shape[-2])
        scores = qf @ k[..., lo:hi, :].float().transpose(-1, -2)
        if causal:
            scores = scores.masked_fill(torch.arange(lo, hi)[None, :] > rows, -math.inf)
        m_new = torch.maximum(m, scores.amax(-1))
        alpha = torch.exp(m - m_new)             # NaN while m and m_new are both -inf
        p = torch.exp(scores - m_new[..., None])
        l = alpha * l + p.sum(-1)
        acc = alpha[..., None] * acc + p @ v[..., lo:hi, :].float()
        m = m_new
    return (acc / l[..., None]).to(q.dtype), m + torch.log(l)
''',
}

FAILS_AT = "Check 3"
