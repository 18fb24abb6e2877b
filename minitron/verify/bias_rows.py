"""The experts' biases of aux-loss-free balancing (moe/balance.py) in the comparison: one row
per step, after both sides' updates, bitwise.

The update adds +-gamma by the sign of integer counts, so a correct split, whose routers made
the reference's choices (the `moe routing` and `moe drops` rows hold them to that, bitwise
too), reaches the reference's biases bit for bit; a bias moved by counts of another set of
tokens (this rank's alone: the plant moe-local-load) is off by gamma or 2 gamma in some expert.
Every rank that holds a layer is compared, not only rank 0: the largest and the smallest bias
over the world (max and min all-reduces; a rank that does not hold a layer adds -inf / +inf),
so a replica that drifted from the others fails the row too. Errors are in units of gamma
(ModelConfig.bias_update_rate): 1 is one update gone the wrong way.
"""
from __future__ import annotations

import math

import torch

from ..moe.balance import moe_by_layer, update_biases
from ..runtime import comm
from .report import Row


def gathered_biases(model, grid) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(max, min) over every rank of each MoE layer's bias, [layers, E] (collective over the
    world), None without expert biases."""
    cfg = model.cfg
    if not (cfg.n_experts and cfg.expert_bias):
        return None
    order = [i for i in range(cfg.n_layers) if cfg.is_moe_layer(i)]
    hi = torch.full((len(order), cfg.n_experts), -math.inf, device=grid.device)
    lo = torch.full_like(hi, math.inf)
    for i, layer in moe_by_layer(model).items():
        hi[order.index(i)] = lo[order.index(i)] = layer.expert_bias
    world = comm.Group("world", range(grid.world_size))   # pg None: torch's default group
    return comm.all_reduce(hi, world, op="max"), comm.all_reduce(lo, world, op="min")


def bias_rows(step: int, gathered, ref) -> list[Row]:
    """Update the reference's biases by its own step's counts, then one row: the largest
    |bias - the reference's| over every rank, layer and expert, in units of gamma."""
    if gathered is None:
        return []
    update_biases(ref.moe_layers())
    want = torch.stack([m.expert_bias for m in ref.moe_layers()]).to(gathered[0].device)
    off = torch.maximum((gathered[0] - want).abs(), (gathered[1] - want).abs()) / ref.cfg.bias_update_rate
    err = float(off.max())
    detail = ""
    if err > 0:
        layer, expert = divmod(int(off.argmax()), off.shape[1])
        detail = (f"MoE layer {layer} expert {expert}: biases {float(gathered[1][layer, expert]):.4g}"
                  f"..{float(gathered[0][layer, expert]):.4g} over the ranks, one device's "
                  f"{float(want[layer, expert]):.4g} (gamma {ref.cfg.bias_update_rate:g})")
    return [Row(step, f"expert bias (spread {float(want.max() - want.min()):.1g})", err, 0.0, detail)]
