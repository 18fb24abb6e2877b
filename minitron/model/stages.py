"""Pipeline stages: the part of ParallelGPT that one pipeline rank holds.

The n_layers blocks are cut into pp * virtual equal stages (pipeline/actions.py): stage s holds
blocks [s*L/S, (s+1)*L/S), S = pp * virtual, and lives on pipeline rank placement[s]
(Megatron's interleaved s % pp by default, ZB-V's V placement as well). Stage 0 also holds the
embedding; the last stage the final norm, the output layer and the loss.

PipelineGPT is a ParallelGPT that holds only its rank's stages, under the reference's GLOBAL
names ("layers.5.mlp.fc1.weight", not "layers.1..."), so its state dict lines up with the
reference's key for key and convert.gather_state_dict can assemble the whole model across
stages. Blocks sit in a ModuleDict keyed by their global index.

Tied embeddings: the output layer reuses the word embedding. When stage 0 and the last stage
are on different ranks, the last stage keeps its own copy (initialised equal, under the same
name) and finalize_grads sums the two copies' gradients over grid.embedding, Megatron's way
(megatron/core/distributed/finalize_model_grads.py, _allreduce_word_embedding_grads), so both
copies take the same step and stay equal. When they are on the same rank (ZB-V: rank 0 holds
the first and the last stage) there is one weight and nothing to sum.

Experts inside stages: each MoE layer's all-to-all runs over its own stage's tp x ep ranks, as
anywhere; its router's auxiliary losses are a term of the loss, so a stage that is not the last
carries its layers' terms into its own backward (executor.carry_aux_loss, Megatron's
MoEAuxLossAutoScaler) and the last stage adds its own to the loss.

Context parallelism needs nothing of its own here: every cp rank of a stage holds the same
stages whole and runs them on its zigzag chunks (the executor shards each micro-batch), the
blocks' attention reaches the other cp ranks through BlockContext (model/blocks.py), and
finalize_grads averages over cp (ParallelGPT's) before the tied embedding's sum over the first
and last stage of each (tp, cp, dp) coordinate's pipeline.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from ..config import ModelConfig
from ..grid import Grid
from ..pipeline.actions import interleaved_placement
from ..runtime import comm
from ..tensor_parallel.layers import VocabParallelEmbedding
from ..tensor_parallel.random import make_dropout_rng
from .blocks import BlockContext, ParallelEmbedding, build_block
from .convert import shard_state_dict, stage_layers
from .fused import check_kernels
from .parallel import ParallelGPT
from .reference import GPT
from .splits import validate_model


def check_placement(cfg: ModelConfig, pp: int, placement: tuple[int, ...]) -> None:
    """ValueError, saying what to change, unless `placement` cuts cfg into stages pp ranks share evenly."""
    n_stages = len(placement)
    if n_stages == 0 or n_stages % pp:
        raise ValueError(f"{n_stages} pipeline stages cannot be shared evenly by pp={pp} ranks: "
                         "give every rank the same number of stages (pp * virtual in all)")
    if any(not 0 <= r < pp for r in placement):
        raise ValueError(f"placement {placement} names pipeline ranks outside 0..{pp - 1}")
    counts = [placement.count(r) for r in range(pp)]
    if len(set(counts)) != 1:
        raise ValueError(f"placement {placement} gives the pipeline ranks {counts} stages: each "
                         f"rank must hold virtual={n_stages // pp}")
    if cfg.n_layers % n_stages:
        raise ValueError(f"n_layers={cfg.n_layers} is not divisible by pp*virtual={n_stages}: every "
                         f"pipeline stage needs the same number of layers; use a multiple of {n_stages}")
    first, last = placement[0], placement[-1]
    if cfg.tie_embeddings and first != last and (first, last) != (0, pp - 1):
        raise ValueError(f"tied embeddings are summed over grid.embedding (pipeline ranks 0 and "
                         f"{pp - 1}), but the placement puts stage 0 on rank {first} and the last "
                         f"stage on rank {last}")


class _WordEmbeddingCopy(nn.Module):
    """The last stage's copy of the tied word embedding, as `embedding.word` (the same name).
    Its forward is the output layer, `project(x)` with this weight: called as a module, so that
    whoever hooks modules sees the weight's use (ZeRO-3 gathers it: data_parallel/zero3.py)."""

    def __init__(self, cfg: ModelConfig, ctx: BlockContext):
        super().__init__()
        self.word = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden, ctx.grid.tp,
                                           sequence_parallel=ctx.grid.sequence_parallel)

    def forward(self, x: torch.Tensor, project) -> torch.Tensor:
        return project(x)


class PipelineGPT(ParallelGPT):
    """The stages of one pipeline rank. stage_forward(s, x) runs stage s on x (for stage 0, x is
    the embedding's output: embed(tokens)); the last stage returns the logits shard [b, s, V/tp]."""

    def __init__(self, cfg: ModelConfig, grid: Grid, placement: tuple[int, ...] | None = None,
                 seed: int = 0):
        nn.Module.__init__(self)
        pp = grid.config.pp
        placement = tuple(placement) if placement is not None else \
            interleaved_placement(pp, grid.config.virtual_pp)
        check_placement(cfg, pp, placement)
        validate_model(dataclasses.replace(grid.config, virtual_pp=len(placement) // pp), cfg)
        if cfg.use_kernels:
            check_kernels(cfg, grid.device)
        self.cfg, self.grid, self.placement = cfg, grid, placement
        self.n_stages = len(placement)
        self.stages = [s for s, r in enumerate(placement) if r == grid.pp.rank]
        self.holds_first, self.holds_last = 0 in self.stages, self.n_stages - 1 in self.stages
        self.tied_across_ranks = cfg.tie_embeddings and placement[0] != placement[-1]
        self.ctx = ctx = BlockContext(cfg, grid)
        if self.holds_first:
            self.embedding = ParallelEmbedding(cfg, ctx)
        elif self.holds_last and cfg.tie_embeddings:
            self.embedding = _WordEmbeddingCopy(cfg, ctx)
        self.layers = nn.ModuleDict({str(i): build_block(cfg, ctx, i) for s in self.stages
                                     for i in stage_layers(cfg, s, self.n_stages)})
        if self.holds_last:
            self._build_head(cfg, grid)
        self.rng = make_dropout_rng(cfg.dropout_rng, seed, grid.tp_rank, device=grid.device)
        self.load_state_dict(shard_state_dict(GPT(cfg, seed).state_dict(), cfg, grid, placement))
        self.to(grid.device)
        if self.tied_across_ranks and (self.holds_first or self.holds_last):
            # One weight in two places: its gradient is summed over grid.embedding before anything
            # reads it, and its norm counted once (data_parallel/ddp.py, precision.grad_norm).
            self.embedding.word.weight.shared_embedding = True

    @classmethod
    def from_reference(cls, ref: nn.Module, grid: Grid, placement: tuple[int, ...] | None = None
                       ) -> "PipelineGPT":
        """This rank's stages, holding its shards of `ref`'s current weights and its RNG seed."""
        model = cls(ref.cfg, grid, placement, seed=ref.rng.seed)
        model.load_state_dict(shard_state_dict(ref.state_dict(), ref.cfg, grid, model.placement))
        return model.to(device=grid.device, dtype=next(ref.parameters()).dtype)

    def stage_forward(self, stage: int, x: torch.Tensor) -> torch.Tensor:
        """Stage `stage`'s blocks on x; the last stage adds the final norm and the output layer."""
        if stage not in self.stages:
            raise ValueError(f"stage {stage} is not on pipeline rank {self.grid.pp.rank} "
                             f"(it holds {self.stages})")
        for i in stage_layers(self.cfg, stage, self.n_stages):
            self.rng.at_layer(i)          # masks are keyed by the GLOBAL layer index
            x = self.layers[str(i)](x, self.rng)
        if stage == self.n_stages - 1:
            return self.output_layer(self.final_norm(x))
        return x

    def output_layer(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(getattr(self, "embedding", None), _WordEmbeddingCopy):   # the tied copy
            return self.embedding(x, super().output_layer)
        return super().output_layer(x)

    def stage_aux_loss(self, stage: int) -> torch.Tensor | None:
        """The routers' auxiliary losses of stage `stage`'s MoE layers, from its last forward."""
        found = [self.layers[str(i)].mlp.aux_loss for i in stage_layers(self.cfg, stage, self.n_stages)
                 if self.cfg.is_moe_layer(i)]
        return sum(found[1:], found[0]) if found else None

    def moe_loss(self) -> torch.Tensor | float:
        """The last stage's auxiliary losses: they join its loss. Every other stage's reach its
        backward through carry_aux_loss (pipeline/executor.py); at pp = 1 this is every layer's."""
        aux = self.stage_aux_loss(self.n_stages - 1) if self.holds_last else None
        return 0.0 if aux is None else aux

    def run_layers(self, x: torch.Tensor) -> torch.Tensor:
        """Every block, then the final norm: only on a rank that holds every stage (pp = 1)."""
        self._check_whole()
        for i, layer in self.layers.items():      # in stage order: 0, 1, ..., L-1
            self.rng.at_layer(int(i))
            x = layer(x, self.rng)
        return self.final_norm(x)

    def _check_whole(self) -> None:
        if len(self.stages) != self.n_stages:
            raise ValueError(f"pipeline rank {self.grid.pp.rank} holds stages {self.stages} of "
                             f"{self.n_stages}: run the model with minitron.pipeline.executor "
                             "(stage_forward(stage, x) runs one stage)")

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None):
        """The whole model, when this rank holds every stage (pp = 1); otherwise use the executor."""
        self._check_whole()
        x = self.embed(tokens)
        for s in self.stages:
            x = self.stage_forward(s, x)
        return x if targets is None else (x, self.loss(x, targets))

    def finalize_grads(self) -> None:
        """The sequence-parallel sums over tp, then the tied embedding's over first+last stage."""
        super().finalize_grads()
        if self.tied_across_ranks and (self.holds_first or self.holds_last):
            weight = self.embedding.word.weight
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight)
            comm.all_reduce(weight.grad, self.grid.embedding)
