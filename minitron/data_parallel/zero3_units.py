"""ZeRO-3's units: which parameters are gathered together, and which group shards them.

    default_units(model)   one unit per layer, plus the embedding, final norm and output layer
    split_units(module)    a unit's experts and tied embeddings apart, each a unit of its own

zero3_shard.py holds one unit's flat shard; zero3.py gathers, frees and reduce-scatters them.
"""
from __future__ import annotations

import torch.nn as nn


def default_units(model: nn.Module) -> list[nn.Module]:
    """One unit per layer, plus the embedding, the final norm and the output layer: those the
    model holds. A pipeline rank (PipelineGPT) holds its stages' layers (a ModuleDict keyed by
    global index), the embedding on the first stage, the final norm and output layer on the last."""
    if not hasattr(model, "layers"):
        raise ValueError("ZeroStage3 needs units= (the modules to gather one at a time) for a "
                         "model without .layers")
    layers = model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers
    first = [model.embedding] if hasattr(model, "embedding") else []
    last = [getattr(model, name) for name in ("final_norm", "lm_head") if hasattr(model, name)]
    return first + list(layers) + last


def _kind(p: nn.Parameter) -> str:
    """experts: summed over dp_cp (moe/layer.py marks them allreduce = False); tied: a pipeline's
    tied embedding, summed over grid.embedding too (model/stages.py); else dense."""
    if getattr(p, "allreduce", True) is False:
        return "experts"
    return "tied" if getattr(p, "shared_embedding", False) else "dense"


def split_units(module: nn.Module) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """(module, its parameters) for `module`'s unit and, apart, for each largest submodule whose
    parameters are all experts or all a tied embedding. Experts are summed and sharded over
    dp_cp, not dense_dp (ddp.reduction_group); a tied embedding's shards are summed over the
    first and last stage, which needs the same layout there. Each such unit is gathered around
    its own module's forward and backward, inside the enclosing module's unit."""
    def kind_of(m):
        kinds = {_kind(p) for p in m.parameters() if p.requires_grad}
        return kinds.pop() if len(kinds) == 1 else None

    if kind_of(module) is not None:
        return [(module, [p for p in module.parameters() if p.requires_grad])]
    nested = []

    def walk(m):
        for child in m.children():
            (nested.append if kind_of(child) not in (None, "dense") else walk)(child)
    walk(module)
    inner = {p for n in nested for p in n.parameters()}
    own = [p for p in module.parameters() if p.requires_grad and p not in inner]
    if any(_kind(p) != "dense" for p in own):
        raise ValueError(f"ZeroStage3: {type(module).__name__} holds expert or tied parameters "
                         "outside a submodule of their own: give them one (or pass units=)")
    return ([(module, own)] if own else []) + \
        [(n, [p for p in n.parameters() if p.requires_grad]) for n in nested]
