"""The pairs `python -m minitron.bench peers` times (peers.py): for each, minitron's training
step and torch's, built on this rank over the same weights and batch, each returning this
rank's loss (None on a pipeline stage without one). peers.py's docstring says what each pair
wraps and why the two sides share a model where torch's wrapper allows it."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..grid import ParallelConfig, build_grid
from ..model.parallel import ParallelGPT
from ..model.reference import GPT

MICROBATCHES = 4
PAIRS = ("DataParallel vs DDP, 25 MB buckets", "DataParallel vs DDP, 1 MB buckets",
         "ZeroStage3 vs FSDP2", "1F1B executor vs Schedule1F1B", "ParallelGPT tp=2 vs DTensor TP")


class PeerGPT(nn.Module):
    """The reference GPT's own modules (its weights, its names), the output layer called as a
    module: the forward torch's wrappers hook into. tokens -> logits [b, s, V]."""

    def __init__(self, ref: GPT):
        super().__init__()
        self.embedding, self.layers, self.final_norm, self.lm_head = (
            ref.embedding, ref.layers, ref.final_norm, ref.lm_head)
        self.rng = ref.rng

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for layer in self.layers:
            x = layer(x, self.rng)
        return self.lm_head(self.final_norm(x))


def _loss(logits, targets) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _rows(tokens, targets):
    from ..train.step import replica_rows
    rows = replica_rows(tokens.shape[0], build_grid(ParallelConfig(dp=2)))
    return tokens[rows], targets[rows]


# Each pair: (minitron's step, torch's step), each returning this rank's loss (or None).
def _replica_pair(cfg, tokens, targets, make_engine, wrap_peer, same_model: bool = False):
    """A data-parallel pair: minitron's engine around a ParallelGPT at dp=2, torch's wrapper
    around another ParallelGPT (same_model) or the reference's own modules, each stepping on
    this replica's rows."""
    tokens, targets = _rows(tokens, targets)
    model = ParallelGPT.from_reference(GPT(cfg, seed=0), build_grid(ParallelConfig(dp=2)))
    engine = make_engine(model)
    if same_model:
        twin = ParallelGPT.from_reference(GPT(cfg, seed=0), build_grid(ParallelConfig(dp=2)))
        peer = wrap_peer(twin)
        peer_loss = lambda: peer(tokens, targets)[1]          # noqa: E731
    else:
        peer = wrap_peer(PeerGPT(GPT(cfg, seed=0)))
        peer_loss = lambda: _loss(peer(tokens), targets)       # noqa: E731

    def ours():
        engine.zero_grad()
        _, loss = model(tokens, targets)
        loss.backward()
        engine.finish_grad_sync()
        return loss

    def theirs():
        peer.zero_grad(set_to_none=True)
        loss = peer_loss()
        loss.backward()
        return loss
    return ours, theirs


def _data_parallel(cfg, tokens, targets, bucket_mb: float):
    from torch.nn.parallel import DistributedDataParallel as DDP
    from ..data_parallel import DataParallel
    return _replica_pair(
        cfg, tokens, targets,
        lambda model: DataParallel(model, model.grid, bucket_numel=int(bucket_mb * 2**20) // 4),
        lambda peer: DDP(peer, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True), same_model=True)


def _zero3(cfg, tokens, targets):
    from torch.distributed.fsdp import fully_shard
    from ..data_parallel.zero3 import ZeroStage3

    def shard(peer):
        for unit in [peer.embedding, *peer.layers, peer.final_norm, peer.lm_head]:  # ZeroStage3's units
            fully_shard(unit)
        fully_shard(peer)
        return peer
    return _replica_pair(cfg, tokens, targets, lambda model: ZeroStage3(model, model.grid), shard)


class _Stage(nn.Module):
    """Pipeline stage s of a PipelineGPT as torch's one-tensor-in, one-tensor-out stage module:
    the very computation minitron's executor runs for it (embed on stage 0, stage_forward)."""

    def __init__(self, model, s: int):
        super().__init__()
        self.model, self.s = model, s

    def forward(self, x):
        return self.model.stage_forward(self.s, self.model.embed(x) if self.s == 0 else x)


def _pipeline(cfg, tokens, targets):
    from torch.distributed import pipelining
    from ..pipeline import make_schedule
    from ..pipeline.executor import run_schedule
    from ..model.stages import PipelineGPT
    m, rank = MICROBATCHES, dist.get_rank()
    schedule = make_schedule("1f1b", 2, m)
    model, twin = (PipelineGPT.from_reference(GPT(cfg, seed=0), build_grid(ParallelConfig(pp=2)),
                                              placement=schedule.stage_rank) for _ in range(2))
    mbs = tokens.shape[0] // m
    act = torch.zeros(mbs, cfg.seq_len, cfg.hidden, requires_grad=True)
    out = torch.zeros(mbs, cfg.seq_len, cfg.vocab_size if rank == 1 else cfg.hidden, requires_grad=True)
    stage = pipelining.PipelineStage(_Stage(twin, rank), rank, 2, torch.device("cpu"),
                                     input_args=tokens[:mbs] if rank == 0 else act, output_args=out)
    peer = pipelining.Schedule1F1B(stage, m, loss_fn=lambda y, t: twin.loss(y, t) / m, scale_grads=False)

    def ours():
        model.zero_grad(set_to_none=True)
        model.rng.reset(0)
        return run_schedule(schedule, model, tokens, targets, keep_outputs=False).loss

    def theirs():
        stage.submod.zero_grad(set_to_none=True)
        losses: list = []
        peer.step(*((tokens,) if rank == 0 else ()), target=targets if rank == 1 else None,
                  losses=losses)
        return torch.stack(losses).sum() if rank == 1 else None
    return ours, theirs


def _tensor_parallel(cfg, tokens, targets):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, loss_parallel,
                                                   parallelize_module)
    model = ParallelGPT.from_reference(GPT(cfg, seed=0), build_grid(ParallelConfig(tp=2)))
    peer = PeerGPT(GPT(cfg, seed=0))
    mesh = init_device_mesh("cpu", (2,))
    plan = {"embedding.word": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in range(cfg.n_layers):
        plan.update({f"layers.{i}.attention.{n}": ColwiseParallel() for n in ("q", "k", "v")})
        plan.update({f"layers.{i}.attention.out": RowwiseParallel(),
                     f"layers.{i}.mlp.fc1": ColwiseParallel(), f"layers.{i}.mlp.fc2": RowwiseParallel()})
    parallelize_module(peer, mesh, plan)

    def ours():
        model.zero_grad(set_to_none=True)
        _, loss = model(tokens, targets)
        loss.backward()
        model.finalize_grads()
        return loss

    def theirs():
        peer.zero_grad(set_to_none=True)
        with loss_parallel():
            loss = _loss(peer(tokens), targets)
            loss.backward()
        return loss.full_tensor()
    return ours, theirs


def build(name: str, cfg, tokens, targets):
    """(minitron's step, torch's step) of the pair called `name` (one of PAIRS)."""
    builders = dict(zip(PAIRS, (
        lambda: _data_parallel(cfg, tokens, targets, 25), lambda: _data_parallel(cfg, tokens, targets, 1),
        lambda: _zero3(cfg, tokens, targets), lambda: _pipeline(cfg, tokens, targets),
        lambda: _tensor_parallel(cfg, tokens, targets))))
    return builders[name]()
