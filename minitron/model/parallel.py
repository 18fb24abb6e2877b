"""The reference GPT, split across a tensor-parallel group (optionally sequence-parallel).

The same model as reference.py, with the same module names, built from the parallel layers
(the blocks and the embedding are in blocks.py):

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
other cp ranks' keys and values by ParallelConfig.cp_variant (ring, allgather, ulysses or hierarchical);
every other layer is per token and runs unchanged. Learned and rotary positions, and every
dropout mask, follow the tokens' global positions (BlockContext.positions, blocks.py). Each
rank's loss is the mean over its own tokens, so finalize_grads averages every gradient over cp.

With ModelConfig.n_experts > 0 the MLP of every moe_every-th block is a ParallelMoE
(minitron/moe/layer.py): its experts spread over the ep group, its tokens dispatched over
tp_ep, its auxiliary losses added by `loss`.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..context_parallel.grads import average_grads_over_cp
from ..grid import Grid
from .splits import validate_model
from ..moe.layer import ParallelMoE
from ..tensor_parallel.cross_entropy import (fused_vocab_parallel_cross_entropy,
                                             vocab_parallel_cross_entropy)
from ..tensor_parallel.grads import allreduce_sequence_parallel_grads
from ..tensor_parallel.layers import ColumnParallelLinear
from ..tensor_parallel.overlap import allgather_matmul
from ..tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                        gather_from_sequence_parallel_region)
from ..tensor_parallel.random import make_dropout_rng
from .blocks import BlockContext, ParallelEmbedding, build_block, mark_sequence_parallel
from ..config import ModelConfig
from .convert import rules, shard_state_dict
from .fused import check_kernels, make_model_norm
from .reference import GPT


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
        if cfg.use_kernels:
            check_kernels(cfg, grid.device)
        self.cfg, self.grid = cfg, grid
        self.ctx = ctx = BlockContext(cfg, grid)
        self.embedding = ParallelEmbedding(cfg, ctx)
        self.layers = nn.ModuleList(build_block(cfg, ctx, i) for i in range(cfg.n_layers))
        self._build_head(cfg, grid)
        self.rng = make_dropout_rng(cfg.dropout_rng, seed, grid.tp_rank, device=grid.device)
        # The same weights as GPT(cfg, seed): initialise the full model once, keep our shards.
        self.load_state_dict(shard_state_dict(GPT(cfg, seed).state_dict(), cfg, grid))
        self.to(grid.device)

    def _build_head(self, cfg: ModelConfig, grid: Grid) -> None:
        """The final norm and, untied, the column-parallel output layer (the last stage's part)."""
        self.final_norm = make_model_norm(cfg)
        mark_sequence_parallel(self.final_norm, grid.sequence_parallel)
        if not cfg.tie_embeddings:
            self.lm_head = ColumnParallelLinear(cfg.hidden, cfg.vocab_size, grid.tp, bias=False,
                                                sequence_parallel=grid.sequence_parallel,
                                                comm_overlap=grid.tp_comm_overlap)

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
        if self.grid.tp_comm_overlap:
            return allgather_matmul(x, self.output_weight(), self.grid.tp)
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

    def tp_replicated(self) -> set[str]:
        """Names of the parameters every tp rank holds whole (convert.rules with no split dim)."""
        return {r.name for r in rules(self.cfg) if r.dim is None}

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
