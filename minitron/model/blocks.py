"""The pieces ParallelGPT (parallel.py) and PipelineGPT (model/stages.py) are built of.

  BlockContext       the grid and the model config every block shares, and what they decide
                     together: the global positions and the dropout masks of this rank's tokens
  ParallelAttention  fused qkv (column-parallel), this rank's heads, attention.out (row-parallel)
  ParallelMLP        fc1 (column-parallel; [gate; up] fused for SwiGLU), fc2 (row-parallel)
  ParallelBlock      norm, attention, norm, MLP (or a ParallelMoE), each with a residual
  ParallelEmbedding  the vocabulary-parallel word table and, learned, the positions

parallel.py's docstring says how the pieces fit together and what each moves.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..context_parallel import context_parallel_attention
from ..context_parallel import positions as cp_positions
from ..grid import Grid
from ..kernels import ops   # imports no triton until a kernel first runs
from ..moe.layer import ParallelMoE
from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from ..tensor_parallel.random import DropoutRNG
from ..config import ModelConfig
from .fused import fused_attention_core, make_model_norm
from .recompute import checkpoint
from .reference import attention_core, rotary


def mark_sequence_parallel(module: nn.Module, sp: bool) -> None:
    """Under SP a replicated module sees only this rank's tokens: its gradient is partial."""
    for p in module.parameters():
        p.sequence_parallel = sp


class BlockContext:
    """What every block needs to know about its place on the grid (not a module): the grid
    itself, in its own names (ctx.grid.tp is the tensor-parallel group, ctx.grid.tp.size its
    size, ctx.grid.cp_rank this rank's coordinate along cp), and the global positions and
    dropout masks of this rank's tokens, which tp, sequence parallelism and cp decide together."""

    def __init__(self, cfg: ModelConfig, grid: Grid):
        self.cfg, self.grid = cfg, grid
        # Attention through context_parallel_attention: needed when cp > 1. At cp = 1 the plain
        # core computes the same; `python -m minitron.bench overhead` turns this on there to
        # time the ring's own machinery with nothing to split.
        self.context_parallel = grid.cp.size > 1

    def cp_positions(self, s_cp: int, device) -> torch.Tensor:
        """Global positions of the s_cp tokens this cp rank holds (its zigzag chunks)."""
        cp = self.grid.cp
        if cp.size == 1:
            return torch.arange(s_cp, device=device)
        return cp_positions(s_cp * cp.size, cp.size, self.grid.cp_rank, device=device)

    def positions(self, s_local: int, device) -> torch.Tensor:
        """Global positions of this rank's s_local tokens (under SP its 1/tp of the cp rank's)."""
        grid = self.grid
        if not grid.sequence_parallel:
            return self.cp_positions(s_local, device)
        lo = grid.tp_rank * s_local
        return self.cp_positions(s_local * grid.tp.size, device)[lo:lo + s_local]

    def dropout(self, x: torch.Tensor, rng: DropoutRNG, training: bool) -> torch.Tensor:
        """Residual/embedding dropout: replicated [b, s, h], or this rank's tokens of the
        sequence under SP or CP (the full mask's columns at their global positions)."""
        grid = self.grid
        sp, cp = grid.sequence_parallel, grid.cp.size
        if not sp and cp == 1:
            return rng.dropout(x, self.cfg.dropout, training)
        b, s_local, h = x.shape
        if cp == 1:
            lo = grid.tp_rank * s_local
            mine = slice(lo, lo + s_local)
        else:
            mine = self.positions(s_local, x.device)
        s_full = s_local * (grid.tp.size if sp else 1) * cp
        return rng.dropout(x, self.cfg.dropout, training, index=(slice(None), mine),
                           full_shape=(b, s_full, h))


class ParallelAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: BlockContext):
        super().__init__()
        self.cfg, self.ctx = cfg, ctx
        hd, tp, sp = cfg.head_dim, ctx.grid.tp, ctx.grid.sequence_parallel
        overlap = ctx.grid.tp_comm_overlap
        self.heads, self.kv_heads = cfg.n_heads // tp.size, cfg.kv_heads // tp.size   # this rank's
        self.qkv = ColumnParallelLinear(cfg.hidden, (cfg.n_heads + 2 * cfg.kv_heads) * hd, tp,
                                        bias=cfg.bias, sequence_parallel=sp, comm_overlap=overlap)
        self.out = RowParallelLinear(cfg.n_heads * hd, cfg.hidden, tp, bias=cfg.bias,
                                     input_is_parallel=True, sequence_parallel=sp,
                                     comm_overlap=overlap)

    def forward(self, x: torch.Tensor, rng: DropoutRNG) -> torch.Tensor:
        hd = self.cfg.head_dim
        qkv = self.qkv(x)                       # [b, s, (hq + 2 hkv) * hd / tp], full sequence
        b, s, _ = qkv.shape
        q, k, v = qkv.split([self.heads * hd, self.kv_heads * hd, self.kv_heads * hd], dim=-1)
        q = q.reshape(b, s, -1, hd).transpose(1, 2)       # [b, heads/tp, s, hd]
        k = k.reshape(b, s, -1, hd).transpose(1, 2)
        v = v.reshape(b, s, -1, hd).transpose(1, 2)
        if self.cfg.position == "rope":          # this cp rank's whole sequence: SP gathered it
            pos = self.ctx.cp_positions(s, x.device)
            q, k = rotary(q, pos, self.cfg.rope_base), rotary(k, pos, self.cfg.rope_base)
        first = self.ctx.grid.tp_rank * self.heads   # our heads in the reference's numbering
        if self.ctx.context_parallel:
            y = self.context_parallel_core(q, k, v, rng, slice(first, first + self.heads))
            return self.out(y.transpose(1, 2).reshape(b, s, -1))
        core = functools.partial(fused_attention_core if self.cfg.use_kernels else attention_core,
                                 cfg=self.cfg, rng=rng, training=self.training,
                                 head_index=slice(first, first + self.heads), full_heads=self.cfg.n_heads)
        if self.cfg.recompute == "selective":   # keep q, k, v; rerun the core in backward
            y = checkpoint(core, rng, q, k, v)
        else:
            y = core(q, k, v)
        return self.out(y.transpose(1, 2).reshape(b, s, -1))

    def context_parallel_core(self, q, k, v, rng: DropoutRNG, heads: slice) -> torch.Tensor:
        """Causal attention of this cp rank's tokens over the whole sequence. Dropout: the
        reference's mask for our heads over all s x s (query, key) positions, applied in
        whichever block each pair is computed."""
        drop, p = None, self.cfg.dropout
        if self.training and p > 0:
            b, _, s_cp, _ = q.shape
            s = s_cp * self.ctx.grid.cp.size
            shape = (b, self.cfg.n_heads, s, s)
            like = q.new_empty(()).expand(b, self.heads, s, s)   # only its shape and device are read
            # keep/(1-p) in the blocks' wide dtype: 1/0.9 rounded to bfloat16 is 0.16% short,
            # a bias every kept probability would carry (the reference rounds x/(1-p) per entry)
            wide = torch.float64 if q.dtype == torch.float64 else torch.float32
            drop = rng.local_mask(like, p, (slice(None), heads), shape).to(wide) / (1.0 - p)
        return context_parallel_attention(q, k, v, self.ctx.grid,
                                          variant=self.ctx.grid.config.cp_variant, causal=True,
                                          scale=self.cfg.head_dim ** -0.5,
                                          use_kernels=self.cfg.use_kernels, drop=drop)


class ParallelMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: BlockContext):
        super().__init__()
        self.cfg = cfg
        width = 2 * cfg.ffn if cfg.activation == "swiglu" else cfg.ffn   # [gate; up] fused
        # With kernels, GeLU's input bias is added inside ops.bias_gelu, in the same pass.
        self.fuse_bias = cfg.use_kernels and cfg.activation == "gelu" and cfg.bias
        tp, sp, overlap = ctx.grid.tp, ctx.grid.sequence_parallel, ctx.grid.tp_comm_overlap
        self.fc1 = ColumnParallelLinear(cfg.hidden, width, tp, bias=cfg.bias, sequence_parallel=sp,
                                        skip_bias_add=self.fuse_bias, comm_overlap=overlap)
        self.fc2 = RowParallelLinear(cfg.ffn, cfg.hidden, tp, bias=cfg.bias, input_is_parallel=True,
                                     sequence_parallel=sp, comm_overlap=overlap)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fuse_bias:
            return self.fc2(ops.bias_gelu(*self.fc1(x)))
        z = self.fc1(x)                          # the activation is elementwise: apply it per shard
        if self.cfg.activation == "swiglu":
            gate, up = z.chunk(2, dim=-1)        # views: the kernel reads them in place
            return self.fc2(ops.swiglu(gate, up) if self.cfg.use_kernels else F.silu(gate) * up)
        return self.fc2(F.gelu(z))


class ParallelBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: BlockContext, moe: bool = False):
        super().__init__()
        self.ctx = ctx
        self.attn_norm = make_model_norm(cfg)
        self.attention = ParallelAttention(cfg, ctx)
        self.mlp_norm = make_model_norm(cfg)
        self.mlp = ParallelMoE(cfg, ctx.grid) if moe else ParallelMLP(cfg, ctx)
        mark_sequence_parallel(self.attn_norm, ctx.grid.sequence_parallel)
        mark_sequence_parallel(self.mlp_norm, ctx.grid.sequence_parallel)

    def forward(self, x: torch.Tensor, rng: DropoutRNG) -> torch.Tensor:
        if self.ctx.cfg.recompute == "full":    # keep x only; rerun the layer in backward
            return checkpoint(self._forward, rng, x, others=(rng,))
        return self._forward(x, rng)

    def _forward(self, x: torch.Tensor, rng: DropoutRNG) -> torch.Tensor:
        drop = self.ctx.dropout
        x = x + drop(self.attention(self.attn_norm(x), rng), rng, self.training)
        return x + drop(self.mlp(self.mlp_norm(x)), rng, self.training)


def build_block(cfg: ModelConfig, ctx: BlockContext, index: int) -> ParallelBlock:
    """Layer `index`'s block: its MLP a mixture of experts where the config says so. Every
    model builds its blocks here (ParallelGPT all of them, a pipeline rank its stages')."""
    return ParallelBlock(cfg, ctx, cfg.is_moe_layer(index))


class ParallelEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: BlockContext):
        super().__init__()
        self.ctx = ctx
        # Under SP the lookup's reduce-scatter leaves [b, s/tp, h]: the sum and the split in one.
        self.word = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden, ctx.grid.tp,
                                           sequence_parallel=ctx.grid.sequence_parallel)
        if cfg.position == "learned":
            self.position = nn.Embedding(cfg.seq_len, cfg.hidden)
            # Under SP each rank adds the rows of its own positions only, so its gradient
            # holds only those rows: it is summed across tp like the norms'.
            mark_sequence_parallel(self.position, ctx.grid.sequence_parallel)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.word(tokens)
        if hasattr(self, "position"):   # under SP and CP only this rank's positions' rows
            x = x + self.position(self.ctx.positions(x.shape[1], tokens.device))
        return x
