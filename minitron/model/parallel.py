"""The reference GPT, split across a tensor-parallel group (optionally sequence-parallel).

The same model as reference.py, with the same module names, built from the parallel layers:

  embedding.word        VocabParallelEmbedding: rows of the table split across tp
  embedding.position    replicated (learned positions only)
  attention.qkv         ONE ColumnParallelLinear holding this rank's q, k and v heads,
                        [q_r; k_r; v_r] per rank (the reference has three Linears q, k, v)
  attention.out         RowParallelLinear
  mlp.fc1               ColumnParallelLinear; for SwiGLU it fuses gate and up: [gate_r; up_r]
                        per rank (the reference has mlp.gate and mlp.fc1)
  mlp.fc2               RowParallelLinear
  *_norm                replicated on every rank
  lm_head               [V/tp, h]: a column-parallel output layer (absent when tied: the
                        embedding's shard is reused, and it is exactly the right shard)

One fused qkv projection means one f (and so one backward all-reduce) per attention block,
and one fused gate/up projection one f per MLP. Per layer the traffic is therefore exactly
two all-reduces of b*s*h elements forward (the g after attention.out and after mlp.fc2)
and two backward (the f before attention.qkv and before mlp.fc1). Under sequence
parallelism each all-reduce becomes an all-gather plus a reduce-scatter of the same payload.

Logits stay split by vocabulary, [b, s, V/tp]; the loss comes from
vocab_parallel_cross_entropy, which never gathers them. Dropout masks come from a DropoutRNG
with the reference's seed. By default (ModelConfig.dropout_rng="exact") every rank draws the
full mask and keeps its slice, so masks match the reference element for element;
dropout_rng="per_rank" seeds each TP rank Megatron's way and draws only the local mask
(see tensor_parallel/random.py). Every dropout call passes `index` exactly when its
activation is split across the group, which is how the RNG knows the region.

ModelConfig(use_kernels=True) swaps in the fused Triton kernels (see fused.py).
ModelConfig(recompute="full" | "selective") recomputes each block, or only its attention
core, in backward (minitron/model/recompute.py), with the same dropout masks.

Context parallelism (grid.cp > 1, minitron/context_parallel): a rank's tokens are its cp rank's
two zigzag chunks of every sequence (then, under SP, its 1/tp of those). Attention reaches the
other cp ranks' keys and values by ParallelConfig.cp_variant (ring, allgather or ulysses);
every other layer is per token and runs unchanged. Learned and rotary positions, and every
dropout mask, follow the tokens' global positions (`_Ctx.positions`). Each rank's loss is the
mean over its own tokens, so finalize_grads averages every gradient over cp.

With ModelConfig.n_experts > 0 the MLP of every moe_every-th block is a ParallelMoE
(minitron/moe/layer.py): its experts spread over the ep group, its tokens dispatched over
tp_ep, its auxiliary losses added by `loss`.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..context_parallel import context_parallel_attention
from ..context_parallel import positions as cp_positions
from ..context_parallel.grads import average_grads_over_cp
from ..grid import Grid, validate_model
from ..kernels import ops   # imports no triton until a kernel first runs
from ..moe.layer import ParallelMoE, check_moe_grid
from .recompute import checkpoint
from ..tensor_parallel.cross_entropy import (fused_vocab_parallel_cross_entropy,
                                             vocab_parallel_cross_entropy)
from ..tensor_parallel.grads import allreduce_sequence_parallel_grads
from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from ..tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                        gather_from_sequence_parallel_region)
from ..tensor_parallel.random import DropoutRNG, make_dropout_rng
from .config import ModelConfig
from .convert import shard_state_dict
from .fused import check_kernels, fused_attention_core, make_model_norm
from .reference import GPT, attention_core, rotary


def _mark_sequence_parallel(module: nn.Module, sp: bool) -> None:
    """Under SP a replicated module sees only this rank's tokens: its gradient is partial."""
    for p in module.parameters():
        p.sequence_parallel = sp


class _Ctx:
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
    def __init__(self, cfg: ModelConfig, ctx: _Ctx):
        super().__init__()
        self.cfg, self.ctx = cfg, ctx
        hd, tp, sp = cfg.head_dim, ctx.grid.tp, ctx.grid.sequence_parallel
        self.heads, self.kv_heads = cfg.n_heads // tp.size, cfg.kv_heads // tp.size   # this rank's
        self.qkv = ColumnParallelLinear(cfg.hidden, (cfg.n_heads + 2 * cfg.kv_heads) * hd, tp,
                                        bias=cfg.bias, sequence_parallel=sp)
        self.out = RowParallelLinear(cfg.n_heads * hd, cfg.hidden, tp, bias=cfg.bias,
                                     input_is_parallel=True, sequence_parallel=sp)

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
            drop = rng.local_mask(like, p, (slice(None), heads), shape).to(q.dtype) / (1.0 - p)
        return context_parallel_attention(q, k, v, self.ctx.grid.cp,
                                          variant=self.ctx.grid.config.cp_variant, causal=True,
                                          scale=self.cfg.head_dim ** -0.5,
                                          use_kernels=self.cfg.use_kernels, drop=drop)


class ParallelMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: _Ctx):
        super().__init__()
        self.cfg = cfg
        width = 2 * cfg.ffn if cfg.activation == "swiglu" else cfg.ffn   # [gate; up] fused
        # With kernels, GeLU's input bias is added inside ops.bias_gelu, in the same pass.
        self.fuse_bias = cfg.use_kernels and cfg.activation == "gelu" and cfg.bias
        tp, sp = ctx.grid.tp, ctx.grid.sequence_parallel
        self.fc1 = ColumnParallelLinear(cfg.hidden, width, tp, bias=cfg.bias,
                                        sequence_parallel=sp, skip_bias_add=self.fuse_bias)
        self.fc2 = RowParallelLinear(cfg.ffn, cfg.hidden, tp, bias=cfg.bias,
                                     input_is_parallel=True, sequence_parallel=sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fuse_bias:
            return self.fc2(ops.bias_gelu(*self.fc1(x)))
        z = self.fc1(x)                          # the activation is elementwise: apply it per shard
        if self.cfg.activation == "swiglu":
            gate, up = z.chunk(2, dim=-1)        # views: the kernel reads them in place
            return self.fc2(ops.swiglu(gate, up) if self.cfg.use_kernels else F.silu(gate) * up)
        return self.fc2(F.gelu(z))


class ParallelBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: _Ctx, moe: bool = False):
        super().__init__()
        self.ctx = ctx
        self.attn_norm = make_model_norm(cfg)
        self.attention = ParallelAttention(cfg, ctx)
        self.mlp_norm = make_model_norm(cfg)
        self.mlp = ParallelMoE(cfg, ctx.grid) if moe else ParallelMLP(cfg, ctx)
        _mark_sequence_parallel(self.attn_norm, ctx.grid.sequence_parallel)
        _mark_sequence_parallel(self.mlp_norm, ctx.grid.sequence_parallel)

    def forward(self, x: torch.Tensor, rng: DropoutRNG) -> torch.Tensor:
        if self.ctx.cfg.recompute == "full":    # keep x only; rerun the layer in backward
            return checkpoint(self._forward, rng, x, others=(rng,))
        return self._forward(x, rng)

    def _forward(self, x: torch.Tensor, rng: DropoutRNG) -> torch.Tensor:
        drop = self.ctx.dropout
        x = x + drop(self.attention(self.attn_norm(x), rng), rng, self.training)
        return x + drop(self.mlp(self.mlp_norm(x)), rng, self.training)


def build_block(cfg: ModelConfig, ctx: _Ctx, index: int) -> ParallelBlock:
    """Layer `index`'s block: its MLP a mixture of experts where the config says so. Every
    model builds its blocks here (ParallelGPT all of them, a pipeline rank its stages')."""
    return ParallelBlock(cfg, ctx, cfg.is_moe_layer(index))


class ParallelEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: _Ctx):
        super().__init__()
        self.ctx = ctx
        # Under SP the lookup's reduce-scatter leaves [b, s/tp, h]: the sum and the split in one.
        self.word = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden, ctx.grid.tp,
                                           sequence_parallel=ctx.grid.sequence_parallel)
        if cfg.position == "learned":
            self.position = nn.Embedding(cfg.seq_len, cfg.hidden)
            # Under SP each rank adds the rows of its own positions only, so its gradient
            # holds only those rows: it is summed across tp like the norms'.
            _mark_sequence_parallel(self.position, ctx.grid.sequence_parallel)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.word(tokens)
        if hasattr(self, "position"):   # under SP and CP only this rank's positions' rows
            x = x + self.position(self.ctx.positions(x.shape[1], tokens.device))
        return x


def _check_ids(ids: torch.Tensor, vocab_size: int, what: str) -> None:
    # A vocab-parallel lookup would quietly give an out-of-range id a zero embedding (no
    # rank owns its row), and the loss a wrong value: refuse it, as nn.Embedding does.
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"{what} ids must lie in [0, vocab_size={vocab_size}); got ids from "
                         f"{low} to {high}: fix the data or enlarge ModelConfig.vocab_size")


class ParallelGPT(nn.Module):
    """forward(tokens) -> logits shard [b, s, V/tp]; forward(tokens, targets) -> (shard, loss).

    Under context parallelism tokens and targets are this cp rank's: context_parallel.
    shard_sequence(x, cp, cp_rank) of the whole sequences; the loss is their mean."""

    def __init__(self, cfg: ModelConfig, grid: Grid, seed: int = 0):
        super().__init__()
        validate_model(grid.config, cfg)
        check_moe_grid(grid.config, cfg)
        if cfg.use_kernels:
            check_kernels(cfg, grid.device)
        self.cfg, self.grid = cfg, grid
        self.ctx = ctx = _Ctx(cfg, grid)
        self.embedding = ParallelEmbedding(cfg, ctx)
        self.layers = nn.ModuleList(build_block(cfg, ctx, i) for i in range(cfg.n_layers))
        self.final_norm = make_model_norm(cfg)
        _mark_sequence_parallel(self.final_norm, grid.sequence_parallel)
        if not cfg.tie_embeddings:
            self.lm_head = ColumnParallelLinear(cfg.hidden, cfg.vocab_size, grid.tp, bias=False,
                                                sequence_parallel=grid.sequence_parallel)
        self.rng = make_dropout_rng(cfg.dropout_rng, seed, grid.tp_rank, device=grid.device)
        # The same weights as GPT(cfg, seed): initialise the full model once, keep our shards.
        self.load_state_dict(shard_state_dict(GPT(cfg, seed).state_dict(), cfg, grid))
        self.to(grid.device)

    @classmethod
    def from_reference(cls, ref: nn.Module, grid: Grid) -> "ParallelGPT":
        """A ParallelGPT holding this rank's shards of `ref`'s current weights and its RNG seed."""
        model = cls(ref.cfg, grid, seed=ref.rng.seed)
        model.load_state_dict(shard_state_dict(ref.state_dict(), ref.cfg, grid))
        ref_param = next(ref.parameters())
        return model.to(device=grid.device, dtype=ref_param.dtype)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """X, the input of the first block: [b, s, h], or [b, s/tp, h] under SP."""
        cp, tp = self.grid.cp.size, self.grid.tp.size
        if tokens.shape[1] * cp > self.cfg.seq_len:
            raise ValueError(f"sequence of {tokens.shape[1] * cp} tokens is longer than "
                             f"ModelConfig.seq_len={self.cfg.seq_len}")
        if self.grid.sequence_parallel and tokens.shape[1] % tp:
            raise ValueError(f"sequence parallelism splits the {tokens.shape[1]} tokens across "
                             f"tp={tp}: use a length that is a multiple of {tp}")
        _check_ids(tokens, self.cfg.vocab_size, "token")
        self.rng.at_layer(-1)
        return self.ctx.dropout(self.embedding(tokens), self.rng, self.training)

    def run_layers(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            self.rng.at_layer(i)          # masks are keyed by layer (tensor_parallel/random.py)
            x = layer(x, self.rng)
        return self.final_norm(x)

    def output_weight(self) -> torch.Tensor:
        """This rank's rows of the output matrix, [V/tp, h]."""
        return self.embedding.word.weight if self.cfg.tie_embeddings else self.lm_head.weight

    def output_layer(self, x: torch.Tensor) -> torch.Tensor:
        """Column-parallel logits [b, s, V/tp] from the final norm's output."""
        if not self.cfg.tie_embeddings:
            return self.lm_head(x)
        # What ColumnParallelLinear.forward does, with the embedding's weight shard.
        if self.grid.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.grid.tp)
        else:
            x = copy_to_tensor_model_parallel_region(x, self.grid.tp)
        return F.linear(x, self.output_weight())

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean over all b*s tokens, the same number as the reference's F.cross_entropy, plus
        the MoE layers' auxiliary losses (this rank's terms: see minitron/moe/layer.py)."""
        _check_ids(targets, self.cfg.vocab_size, "target")
        ce = fused_vocab_parallel_cross_entropy if self.cfg.use_kernels else vocab_parallel_cross_entropy
        return ce(logits, targets, self.grid.tp).mean() + self.moe_loss()

    def moe_layers(self) -> list[ParallelMoE]:
        return [m for m in self.modules() if isinstance(m, ParallelMoE)]   # PipelineGPT's too

    def moe_loss(self) -> torch.Tensor | float:
        """The routers' auxiliary losses of the last forward (0.0 without experts)."""
        return sum((m.aux_loss for m in self.moe_layers()), 0.0)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None):
        logits = self.output_layer(self.run_layers(self.embed(tokens)))
        if targets is None:
            return logits
        return logits, self.loss(logits, targets)

    def finalize_grads(self) -> None:
        """Call after backward, before the optimizer step (see tensor_parallel/grads.py and
        context_parallel/grads.py; with DataParallel call its finish_grad_sync instead)."""
        allreduce_sequence_parallel_grads(self, self.grid.tp)
        average_grads_over_cp(self, self.grid.cp)
