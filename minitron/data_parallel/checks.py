"""Whole tensors out of sharded storage, and back in: for comparisons with the reference only.

Under ZeRO no rank holds a whole gradient (stages 1-3) or a whole weight (stage 3). The
verifier still compares every tensor, so these helpers rebuild them: each rank puts the
pieces it keeps into a zero tensor of the full shape and an all-reduce (sum) over the
sharding group fills in the rest (every element is kept by exactly one rank, so the sum is
exact): one all-reduce per group and dtype, of all its tensors side by side. This costs
traffic no training step pays; it is never called by one.
"""
from __future__ import annotations

import torch

from ..runtime import comm
from .engine_api import GradientEngine


def _assemble(engine: GradientEngine, pieces_of, replicated: bool,
              dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    out = {}
    to_sum: dict = {}          # (sharding group, dtype) -> (group, its tensors): one all-reduce each
    for p in engine.parameters:
        full = torch.zeros(p.numel(), dtype=dtype or p.dtype, device=p.device)
        for i, t in pieces_of(p):
            full[i:i + t.numel()].copy_(t)
        if not replicated:
            group = engine.group_of(p)
            to_sum.setdefault((id(group), full.dtype), (group, []))[1].append(full)
        out[engine.names[p]] = full.view(p.shape)
    for group, fulls in to_sum.values():     # in the same order on every rank of a group
        flat = torch.cat(fulls)
        comm.all_reduce(flat, group)
        for full, summed in zip(fulls, flat.split([f.numel() for f in fulls])):
            full.copy_(summed)
    return out


def gathered_grads(engine: GradientEngine) -> dict[str, torch.Tensor]:
    """{name: this rank's whole (data-parallel reduced) gradient}, keyed like the state dict."""
    return _assemble(engine, engine.grad_pieces, engine.grads_replicated)


def gathered_params(engine: GradientEngine) -> dict[str, torch.Tensor]:
    """{name: whole parameter}: stage 3 gathers the shards; other stages hold them whole."""
    if engine.zero_stage != 3:
        return {engine.names[p]: p.detach().clone() for p in engine.parameters}
    return _assemble(engine, engine.param_pieces, False)


def master_pieces(engine: GradientEngine, master: torch.Tensor, p) -> list[tuple[int, torch.Tensor]]:
    """(index into p.view(-1), view of `master`) for each piece of p this rank's optimizer
    steps: `master` is a ZeroOptimizer's flat fp32 copy of engine.owned_params(), end to end."""
    owned = engine.owned_params()
    spans = list(zip(owned, master.split([t.numel() for t in owned])))
    if hasattr(engine, "param_pieces"):          # ZeRO-3: the pieces of p in this rank's shards
        views = engine.param_pieces(p)
    else:                                        # the flat buffer's pieces of p this rank owns
        gb = engine.buffer_of[p]
        o = gb.layout.offset[p]
        views = [(i, gb.params_flat[o + i:o + i + ln]) for i, _, ln in gb.layout.pieces(p, gb.owned)]
    out = []
    for i, view in views:
        for t, m in spans:
            lo = view.storage_offset() - t.storage_offset()
            if view.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() and 0 <= lo < t.numel():
                out.append((i, m[lo:lo + view.numel()]))
    return out


def gathered_masters(engine: GradientEngine, master: torch.Tensor) -> dict[str, torch.Tensor]:
    """{name: whole fp32 master weight} of a 16-bit model (the optimizer's state, the weight
    its update is made in): each rank's owned pieces, summed over the shard group."""
    return _assemble(engine, lambda p: master_pieces(engine, master, p), engine.grads_replicated,
                     torch.float32)


@torch.no_grad()
def load_grads(engine: GradientEngine, grads: dict[str, torch.Tensor]) -> None:
    """Write whole, already reduced gradients into the pieces `engine` keeps (the verifier
    steps both optimizers on the reference's gradients, so the step is checked on its own)."""
    for p in engine.parameters:
        g = grads[engine.names[p]].reshape(-1)
        for i, t in engine.grad_pieces(p):
            t.copy_(g[i:i + t.numel()])
