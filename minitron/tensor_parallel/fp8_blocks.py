"""Fine-grained FP8: a scale per block of a tensor instead of one per tensor (fp8.py).

One outlier 100x the rest forces a per-tensor scale 100x smaller, and every other entry of the
tensor loses digits (or flushes to zero). A scale per small block confines the damage to the
outlier's block. Two recipes:

  blockwise  DeepSeek-V3's (report §3.3.2, "fine-grained quantization"; Transformer Engine's
             Float8BlockScaling): activations and gradients in 1 x 128 tiles (one row, 128
             consecutive elements along the GEMM's K dimension), weights in 128 x 128 blocks;
             each block's scale s = 448 / amax(block), a float32 number (not a power of two).
             E4M3 for every tensor, gradients included: DeepSeek-V3 chose "the E4M3 format on
             all tensors for higher precision" (§3.3.2) because the tiles' own scales give each
             tile the range E5M2 was there to buy; E4M3's extra mantissa bit halves the error.
  mxfp8      OCP Microscaling (MX spec v1.0, §5.3 and §6.3): blocks of 32 consecutive elements
             along K for every operand (weights too, so a weight has a row-wise copy for the
             forward and a column-wise one for dgrad), each with an E8M0 scale, a power of two:
             X = 2^(floor(log2(amax)) - emax_elem), emax_elem = 8 for E4M3 (448 = 1.75 * 2^8),
             15 for E5M2; the elements are E4M3(x / X), saturated (amax / X lies in [256, 512),
             so a block's largest entries above 448 clamp to 448). Here s = 1 / X, kept in
             2^-127 .. 2^127, E8M0's range. E4M3 elements for every tensor (MXFP8's usual
             choice, Transformer Engine's MXFP8BlockScaling default).

Which dimension is K. y = x W^T: x [tokens, in] in tiles along `in`, W [out, in] in 128 x 128
blocks (mxfp8: 1 x 32 along `in`). dgrad dx = g W: g [tokens, out] in tiles along `out`, W in
the same 128 x 128 blocks (a 2-D block is its own transpose's block: one cast serves both GEMMs;
mxfp8 casts W again, 32 along `out`). wgrad dW = g^T x, K = tokens: g and x in tiles along the
tokens (128 x 1, DeepSeek-V3's "re-quantized into 128x1 tiles" for the backward, §3.5.2). Every
cast is made in the forward or just before its GEMM from the 16-bit tensor, and the FP8 copies
(1 byte an element, plus a scale per block) are what the backward keeps.

Accumulation. DeepSeek-V3 promotes the tensor cores' partial sums to float32 registers every
128 products along K, multiplying in both blocks' scales there (§3.3.2, "increasing
accumulation precision"). The CPU emulation dequantizes each operand block by block
(q * (1/s), float32) and multiplies the float32 values: every product and every sum is a float32
operation, which is that promotion with no limited-precision accumulator in between (the
tensor cores' ~14-bit accumulation that the promotion works around is never emulated).

Blocks and shards. Each rank casts its own local tensor with its own blocks, counted from its
first element (Transformer Engine's way: a last block that does not fill is a short block). A
block's scale is its own amax's, so blockwise scales need no amax history (they are current
scaling, block by block) and, as long as no block spans two ranks' pieces, no amax reduction
over the amax group: each block lies whole on one rank, which computes exactly the scale one
device computes for it. That holds when the block size divides every piece a split cuts a
blocked dimension into (tp shards of q, k, v, gate, up, hidden; dp, micro-batch or cp pieces of
the tokens); `largest_block` picks that size for the verifier (tiny models: hidden 64, tp 2,
shards of 32 features: block 32, not 128). Where a block would span ranks, each rank's blocks are
its own and no single device casts alike (the training run still works: Transformer Engine does
the same). Checkpoints keep no scales for these recipes (nothing carries over between uses),
and a recomputed forward recasts its identical inputs into identical blocks.

With --tp-comm-overlap the rings run these GEMMs chunk by chunk (BlockRingGemms): every chunk's
casts are the unchunked layer's, and dL/dW, whose tiles cross the chunks, runs once after the ring.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from . import weight_grad
from .fp8 import BLOCK_RECIPES, FLOAT32_MAX, fp8_max
from .overlap import RingGemms

DEFAULT_BLOCK = {"blockwise": 128, "mxfp8": 32}
E8M0_LIMIT = 127           # an E8M0 scale is 2^e, -127 <= e <= 127


def emax_elem(fmt: torch.dtype) -> int:
    """The exponent of the format's largest normal: 8 for E4M3 (448), 15 for E5M2 (57344)."""
    return math.floor(math.log2(fp8_max(fmt)))


def block_amax(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The amax of every rows x cols block of the 2-D x, [ceil(m / rows), ceil(n / cols)]; the
    last block of a dimension that does not fill is a short block (zeros pad it)."""
    m, n = x.shape
    bm, bn = -(-m // rows), -(-n // cols)
    if (bm * rows, bn * cols) == (m, n):          # whole blocks: nothing to pad
        return x.detach().float().abs().reshape(bm, rows, bn, cols).amax(dim=(1, 3))
    padded = torch.zeros(bm * rows, bn * cols, dtype=torch.float32, device=x.device)
    padded[:m, :n] = x.detach().float().abs()
    return padded.reshape(bm, rows, bn, cols).amax(dim=(1, 3))


def block_scale(a: torch.Tensor, fmt: torch.dtype, pow2: bool) -> torch.Tensor:
    """Each block's scale from its amax: max / amax (blockwise) or 2^(emax_elem - floor(log2
    amax)) (mxfp8); 1 where amax is 0 or not finite (such a block holds zeros or is lost)."""
    ok = (a > 0) & torch.isfinite(a)
    safe = torch.where(ok, a, torch.ones_like(a))
    if pow2:
        _, e = torch.frexp(safe)                   # safe = m 2^e, m in [0.5, 1): floor(log2) = e - 1
        shift = (emax_elem(fmt) - (e - 1)).clamp(-E8M0_LIMIT, E8M0_LIMIT)
        s = torch.ldexp(torch.ones_like(safe), shift)
    else:
        # max / amax correctly rounded (torch's scalar / tensor is reciprocal-then-multiply)
        s = (torch.full_like(safe, fp8_max(fmt)) / safe).clamp(max=FLOAT32_MAX)
    return torch.where(ok, s, torch.ones_like(a))


def expand(s: torch.Tensor, rows: int, cols: int, shape) -> torch.Tensor:
    """The block scales spread over the elements they scale, cut to `shape`."""
    bm, bn = s.shape
    full = s[:, None, :, None].expand(bm, rows, bn, cols).reshape(bm * rows, bn * cols)
    return full[:shape[0], :shape[1]]


class Blocks:
    """An FP8 tensor with a scale per rows x cols block: q [m, n], s [ceil(m/rows), ceil(n/cols)]."""

    def __init__(self, q: torch.Tensor, s: torch.Tensor, rows: int, cols: int):
        self.q, self.s, self.rows, self.cols = q, s, rows, cols

    def dequantize(self) -> torch.Tensor:
        """float32 q / s, block by block (as q * (1/s), the scale-inverse a GEMM applies)."""
        return self.q.float() * expand(self.s, self.rows, self.cols, self.q.shape).reciprocal()

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q, self.s

    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.s.numel() * self.s.element_size()


def quantize_blocks(x: torch.Tensor, fmt: torch.dtype, rows: int, cols: int, pow2: bool,
                    scales: torch.Tensor | None = None) -> Blocks:
    """x (2-D) cast to `fmt` with a scale per rows x cols block (fp8(x s), saturated)."""
    s = block_scale(block_amax(x, rows, cols), fmt, pow2) if scales is None else scales
    big = fp8_max(fmt)
    q = (x.float() * expand(s, rows, cols, x.shape)).clamp(-big, big).to(fmt)
    return Blocks(q, s, rows, cols)


class BlockScaler:
    """One tensor's casts under a fine-grained recipe: no history, no scale carried between uses
    (its state is the count of uses only). Of the latest cast, `last` is the largest block scale
    (its smallest block's: noisy) and `smallest` the smallest of the blocks not all zeros (the
    whole tensor's amax's: stable); verify/fp8_rows.py checks both against one device's."""

    def __init__(self, fmt: torch.dtype, recipe):
        self.fmt, self.recipe = fmt, recipe
        self.pow2 = recipe.scaling == "mxfp8"
        self.history = self.scale = self.last = self.smallest = None
        self.uses = 0

    def cast(self, x: torch.Tensor, rows: int, cols: int) -> Blocks:
        """x (2-D) in rows x cols blocks."""
        self.uses += 1
        blocks = self.quantize(x, rows, cols)
        self.last = blocks.s.max()
        held = block_amax(blocks.q, blocks.rows, blocks.cols) > 0   # a zero block: scale 1, no amax
        self.smallest = blocks.s[held].min() if held.any() else None
        return blocks

    def quantize(self, x: torch.Tensor, rows: int, cols: int) -> Blocks:
        """The cast itself (the plants of verify/plants_fp8.py replace this)."""
        return quantize_blocks(x, self.fmt, rows, cols, self.pow2)

    def state_dict(self) -> dict:
        return {"history": None, "scale": None, "uses": self.uses}

    def load_state_dict(self, state: dict) -> None:
        self.uses = int(state["uses"])


def block_size(recipe) -> int:
    return recipe.block if recipe.block is not None else DEFAULT_BLOCK[recipe.scaling]


def tiles(recipe) -> dict[str, tuple[int, int]]:
    """Each cast's block shape, (rows, cols) of the 2-D tensor as the GEMM holds it."""
    b = block_size(recipe)
    w = (b, b) if recipe.scaling == "blockwise" else (1, b)
    return {"x": (1, b), "x_tokens": (b, 1), "w": w, "w_dgrad": w if recipe.scaling == "blockwise"
            else (b, 1), "g": (1, b), "g_tokens": (b, 1)}


def largest_block(pieces, most: int) -> int:
    """The largest power of two <= `most` dividing every piece (the sizes a split cuts the
    blocked dimensions into): blocks that never span two ranks."""
    b = 1 << (most.bit_length() - 1)
    while b > 1 and any(p % b for p in pieces):
        b //= 2
    return b


def split_pieces(pcfg, mcfg, rows: int, seq: int) -> dict[str, int]:
    """{what: its length} for every piece a split cuts a blocked dimension into: a tp rank's q,
    k / v, and gate / up (fc1, fc2's K) features; the tokens of one GEMM call, K of dW (`rows`
    sequences of `seq`), where replicas, micro-batches or cp chunks split them (a cp rank's two
    zigzag chunks of seq / 2cp each)."""
    out, hd = {}, mcfg.head_dim
    if pcfg.tp > 1:
        out.update({"q features per tp rank": mcfg.n_heads * hd // pcfg.tp,
                    "k, v features per tp rank": mcfg.kv_heads * hd // pcfg.tp,
                    "ffn features per tp rank": mcfg.ffn // pcfg.tp})
    if pcfg.cp > 1:
        out["tokens per cp chunk"] = seq // (2 * pcfg.cp)
    elif (pcfg.dp * pcfg.ep > 1 or pcfg.pp > 1 or pcfg.virtual_pp > 1):
        out["tokens per GEMM call"] = rows * seq
    return out


def fit_block(recipe, pieces: dict[str, int]):
    """The recipe with its block set to one no split cuts (largest_block) where it has none;
    ValueError (naming a size that works) where the one it has would span two ranks' pieces."""
    if not recipe.fine_grained:
        return recipe
    if recipe.block is None:
        return dataclasses.replace(recipe, block=largest_block(pieces.values(), block_size(recipe)))
    cut = {k: v for k, v in pieces.items() if v % recipe.block}
    if cut:
        works = largest_block(pieces.values(), recipe.block)
        where = ", ".join(f"{k} {v}" for k, v in cut.items())
        raise ValueError(f"FP8 block {recipe.block} spans two ranks' pieces ({where}), so no "
                         f"single device casts alike: use block={works}")
    return recipe


class _BlockFP8Linear(torch.autograd.Function):
    """y = x W^T + b with every operand cast in blocks (tiles(), the module docstring's K's);
    `gemm(a, b, out_dtype)` multiplies two dequantized float32 matrices (fp8_linear's, so the
    verifier's twins can split its K as they split every FP8 GEMM)."""
    @staticmethod
    def forward(ctx, x, weight, bias, state, gemm):
        t = tiles(state.recipe)
        x2 = x.reshape(-1, x.shape[-1])                              # [tokens, in]
        qx, qw = state.input.cast(x2, *t["x"]), state.weight.cast(weight, *t["w"])
        y = gemm(qx.dequantize(), qw.dequantize().t(), x.dtype).reshape(*x.shape[:-1], -1)
        qx_t = state.input.cast(x2, *t["x_tokens"])                  # for dW: K = tokens
        qw_d = qw if t["w_dgrad"] == t["w"] else state.weight.cast(weight, *t["w_dgrad"])
        ctx.blocks, ctx.state, ctx.gemm = (qx_t, qw_d), state, gemm
        ctx.has_bias, ctx.dtypes = bias is not None, (x.dtype, weight.dtype)
        ctx.params = (weight, bias) if weight_grad.STORE.capturing else None   # may defer dL/dW
        return y + bias if bias is not None else y

    @staticmethod
    def backward(ctx, dy):
        (qx_t, qw_d), state, gemm, t = ctx.blocks, ctx.state, ctx.gemm, tiles(ctx.state.recipe)
        x_dtype, w_dtype = ctx.dtypes
        g = dy.reshape(-1, dy.shape[-1])                             # [tokens, out]
        qg = state.grad.cast(g, *t["g"])
        dx = gemm(qg.dequantize(), qw_d.dequantize(), x_dtype).reshape(*dy.shape[:-1], -1)
        qg_t = state.grad.cast(g, *t["g_tokens"])

        def weight_grads():      # the W of a zero-bubble schedule: the same GEMM, later
            return gemm(qg_t.dequantize().t(), qx_t.dequantize(), w_dtype), \
                g.sum(0) if ctx.has_bias else None
        if ctx.params is not None and weight_grad.defer(ctx.params, weight_grads, qg_t.nbytes()):
            return dx, None, None, None, None
        return (dx, *weight_grads(), None, None)


def block_linear(x, weight, bias, state, gemm) -> torch.Tensor:
    """F.linear(x, weight, bias) with block-scaled FP8 GEMMs; `state` an FP8State of BlockScalers."""
    return _BlockFP8Linear.apply(x, weight, bias, state, gemm)


class BlockRingGemms(RingGemms):
    """_BlockFP8Linear's GEMMs on the chunks of --tp-comm-overlap's rings (overlap.py), making
    the very casts the unchunked layer makes. The weight is cast once, before the ring. The
    forward's x and dL/dx's g are cast chunk by chunk: their tiles lie along a row (K = the
    features) and a chunk holds whole rows, so each chunk's tiles are the unchunked cast's. dL/dW's
    tiles run down the tokens (K = tokens), whose chunks (s/tp tokens of each sequence) need not
    hold whole tiles, and a tile's scale is the amax of all its tokens: so dL/dW is one GEMM on
    the gathered tensors after the ring (wgrad_whole), cast there as the unchunked layer casts
    them, for any block and chunk. Each logical cast counts one use."""
    wgrad_dtype = torch.float32
    wgrad_whole = True

    def __init__(self, state, gemm):
        self.state, self.gemm, self.t = state, gemm, tiles(state.recipe)

    def begin_forward(self, x, weight):
        st, t = self.state, self.t
        self.w = st.weight.cast(weight, *t["w"]).dequantize()
        self.w_dgrad = self.w if t["w_dgrad"] == t["w"] else \
            st.weight.cast(weight, *t["w_dgrad"]).dequantize()
        st.input.uses += 1                   # forward()'s casts of the chunks: one use
        self.dtype = x.dtype

    def begin_backward(self, dy):
        self.state.grad.uses += 1            # dgrad()'s casts of the chunks: one use

    def forward(self, x, weight):
        qx = self.state.input.quantize(x.reshape(-1, x.shape[-1]), *self.t["x"])
        return self.gemm(qx.dequantize(), self.w.t(), self.dtype).reshape(*x.shape[:-1], -1)

    def dgrad(self, dy, weight):
        qg = self.state.grad.quantize(dy.reshape(-1, dy.shape[-1]), *self.t["g"])
        return self.gemm(qg.dequantize(), self.w_dgrad, self.dtype).reshape(*dy.shape[:-1], -1)

    def wgrad(self, dy, x):                  # dy, x: the whole gathered tensors
        st, t = self.state, self.t
        qx_t = st.input.cast(x.reshape(-1, x.shape[-1]), *t["x_tokens"])
        qg_t = st.grad.cast(dy.reshape(-1, dy.shape[-1]), *t["g_tokens"])
        return self.gemm(qg_t.dequantize().t(), qx_t.dequantize(), torch.float32)


__all__ = ["BLOCK_RECIPES", "DEFAULT_BLOCK", "E8M0_LIMIT", "emax_elem", "block_amax",
           "block_scale", "expand", "Blocks", "quantize_blocks", "BlockScaler", "block_size",
           "tiles", "largest_block", "split_pieces", "fit_block", "block_linear", "BlockRingGemms"]
