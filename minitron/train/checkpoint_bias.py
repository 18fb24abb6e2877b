"""The experts' biases of aux-loss-free balancing in a checkpoint (moe/balance.py).

A bias is not a parameter (no gradient, no optimizer state) and not in the state dict, but it
is state: a resumed run must route with the biases the saved one had reached, or its next
steps differ from the uninterrupted run's. Every rank holding a layer holds the same bias (the
update applies summed counts), so the checkpoint keeps one copy per MoE layer, taken over the
pipeline's stages, in the manifest: float32 values survive JSON exactly, and the list does not
depend on the grid, so a bias saved at ep=2, pp=2 loads at any other grid.
"""
from __future__ import annotations

import os

import torch

from ..moe.balance import moe_by_layer
from ..runtime import comm
from .checkpoint_manifest import CheckpointError


def _moe_indices(cfg) -> list[int]:
    return [i for i in range(cfg.n_layers) if cfg.is_moe_layer(i)]


def biases_of_every_stage(model) -> list[list[float]] | None:
    """[MoE layer][expert] biases of the whole model, in layer order, on every rank (one
    all-reduce over pp: each layer lives on one pipeline rank), None without expert biases."""
    cfg = model.cfg
    if not (cfg.n_experts and cfg.expert_bias):
        return None
    order = _moe_indices(cfg)
    flat = torch.zeros(len(order), cfg.n_experts, dtype=torch.float32, device=model.grid.device)
    for i, layer in moe_by_layer(model).items():
        flat[order.index(i)] = layer.expert_bias
    comm.all_reduce(flat, model.grid.pp)
    return flat.tolist()


def load_biases(model, saved: list | None, path: str) -> None:
    """Set this rank's layers' biases from a manifest's list (`saved`). A checkpoint without one
    whose model has biases came from before they were updated: they were zeros, and stay so."""
    layers = moe_by_layer(model)
    if not layers or next(iter(layers.values())).expert_bias is None or saved is None:
        return
    order = _moe_indices(model.cfg)
    if len(saved) != len(order) or any(len(b) != model.cfg.n_experts for b in saved):
        raise CheckpointError(f"{os.path.join(path, 'manifest.json')}: expert_bias holds "
                              f"{len(saved)} layers' biases, this model has {len(order)} MoE layers "
                              f"of {model.cfg.n_experts} experts")
    with torch.no_grad():
        for i, layer in layers.items():
            layer.expert_bias.copy_(torch.tensor(saved[order.index(i)], dtype=torch.float32))
