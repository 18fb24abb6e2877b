"""Which piece of which reference tensor a rank holds (its placements, for
torch.distributed.checkpoint), and a data-parallel engine's optimizer state as whole tp-local
tensors and back (ZeRO's flat shards do not map to rectangles of the reference tensors).
checkpoint.py saves and loads through these."""
from __future__ import annotations

import torch

from ..data_parallel import ZeroStage3
from ..data_parallel.checks import gathered_params
from ..model.convert import reference_shapes, rules, stage_rules
from ..runtime import comm


# ---- placements: which piece of which reference tensor this rank holds ----------------------
def _my_rules(model) -> list:
    cfg, placement = model.cfg, getattr(model, "placement", None)
    if placement is None:
        return rules(cfg)
    mine = [s for s, r in enumerate(placement) if r == model.grid.pp.rank]
    return stage_rules(cfg, mine, len(placement))


def placements(local: dict, model, prefix: str) -> dict:
    """{prefix + reference name: (piece, global shape, offsets)} of this rank's tp-local tensors.

    A split rule's tensor is [part_0 chunk; part_1 chunk; ...] along its dim (convert.Rule):
    each part's chunk is the tp_rank-th of tp equal pieces of that reference tensor."""
    shapes, grid = reference_shapes(model.cfg), model.grid
    tp, r = grid.tp.size, grid.tp.rank
    out = {}
    for rule in _my_rules(model):
        t = local[rule.name]
        if rule.experts:                 # this ep rank's experts, each split over tp at rule.dim
            offsets = [0] * t.dim()
            offsets[0] = grid.ep.rank * t.shape[0]
            if rule.dim is not None:
                offsets[rule.dim] = r * t.shape[rule.dim]
            out[prefix + rule.parts[0]] = (t, shapes[rule.parts[0]], tuple(offsets))
            continue
        if rule.dim is None:
            out[prefix + rule.parts[0]] = (t, shapes[rule.parts[0]], (0,) * t.dim())
            continue
        sizes = [shapes[p][rule.dim] // tp for p in rule.parts]
        for part, piece in zip(rule.parts, t.split(sizes, rule.dim)):
            offsets = [0] * t.dim()
            offsets[rule.dim] = r * piece.shape[rule.dim]
            out[prefix + part] = (piece, shapes[part], tuple(offsets))
    return out


# ---- the engine's tensors as whole tp-local tensors, and back -------------------------------
def _owned_pieces(engine) -> list[tuple]:
    """(param, index into param.view(-1), index into the optimizer's flat state, length) for
    every element this rank's ZeroOptimizer steps (data_parallel/zero.py: the flat state is
    engine.owned_params() end to end)."""
    out, base = [], 0
    if isinstance(engine, ZeroStage3):
        for u in engine.units:
            out += [(p, i, base + j, n) for p in u.params for i, j, n in u.layout.pieces(p, [u.range])]
            base += u.range[1] - u.range[0]
        return out
    for gb in engine.buffers:                                        # DataParallel, stages 0-2
        out += [(p, i, base + j, n) for p in gb.layout.params for i, j, n in gb.layout.pieces(p, gb.owned)]
        base += sum(e - s for s, e in gb.owned)
    return out


def _sharding_group(engine, p):
    """The group p's optimizer state is sharded over; None: every rank steps all of p."""
    return engine.group_of(p) if engine.zero_stage >= 1 else None


def _state_to_local(engine, flat: torch.Tensor) -> dict:
    """{param name: whole tp-local tensor} of a flat optimizer state (collective over dp)."""
    full = {p: torch.zeros(p.numel(), dtype=flat.dtype, device=flat.device) for p in engine.parameters}
    for p, i, j, n in _owned_pieces(engine):
        full[p][i:i + n] = flat[j:j + n]
    for p in engine.parameters:           # each element is owned by exactly one rank of its group
        if _sharding_group(engine, p) is not None:
            comm.all_reduce(full[p], _sharding_group(engine, p))
    return {engine.names[p]: t.view(p.shape) for p, t in full.items()}


def _local_to_state(engine, local: dict, flat: torch.Tensor) -> None:
    for p, i, j, n in _owned_pieces(engine):
        flat[j:j + n].copy_(local[engine.names[p]].reshape(-1)[i:i + n])


def local_weights(model, engine=None) -> dict:
    """{name: whole tp-local weight} of this rank (ZeRO-3: gathered over dp, collective)."""
    if isinstance(engine, ZeroStage3):                              # gather the shards
        return gathered_params(engine)
    return {n: p.detach() for n, p in model.named_parameters()}


@torch.no_grad()
def _write_weights(model, engine, local: dict) -> None:
    params = dict(model.named_parameters())
    if isinstance(engine, ZeroStage3):
        for p in engine.parameters:
            w = local[engine.names[p]].reshape(-1)
            for i, piece in engine.param_pieces(p):
                piece.copy_(w[i:i + piece.numel()])
        return
    for name, t in local.items():
        params[name].copy_(t)
