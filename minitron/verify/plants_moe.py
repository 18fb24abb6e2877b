"""The expert plants moe-route, moe-split and moe-unpermute (plants.py): one MoE layer's
dispatch with a fault, its code untouched (the layer's dispatcher is wrapped); and
moe-local-load: the expert biases moved by this rank's own counts (balance.reduce_loads off);
moe-topk: the split's routers choose one token's expert wrongly (moe/layer.py's route wrapped)."""
from __future__ import annotations

import dataclasses

import torch

from ..moe import balance
from ..moe import layer as moe_layer
from .patching import patched


def local_loads():
    """Around the optimizer step: the loads are not summed over the ranks holding other tokens,
    so each rank moves its biases by the counts of its own share of the batch."""
    return patched(balance, "reduce_loads", lambda loads, groups: loads)


def plant_dispatch(layer, kind: str) -> None:
    """One MoE layer's dispatch with a fault, its code untouched: the layer's dispatcher is
    wrapped. "route": the first token's first choice goes to an expert the router did not
    choose; "split": the grouped matmul runs one row of the first local expert with the next;
    "unpermute": the expert outputs, in grouped order, are off by one row when the regrouping
    is undone, so they return to the wrong tokens."""
    if kind not in ("route", "split", "unpermute"):
        raise ValueError(f"unknown dispatch fault {kind!r}: route, split or unpermute")
    dispatch, n_experts = layer.dispatcher, layer.cfg.n_experts

    def planted(x, r, experts):
        if kind == "route":
            if x.shape[0]:
                r.experts = _misroute_first_token(r.experts, n_experts)
            return dispatch(x, r, experts)

        def faulty(rows, counts, bias_rows):
            if kind == "unpermute":
                return experts(rows, counts, bias_rows).roll(1, 0)
            if len(counts) > 1 and counts[0] > 0:                      # split
                counts = [counts[0] - 1, counts[1] + 1, *counts[2:]]
            return experts(rows, counts, bias_rows)
        return dispatch(x, r, faulty)
    layer.dispatcher = planted


def _misroute_first_token(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Token 0's first choice replaced by the lowest expert it did not choose."""
    wrong = experts.clone()
    wrong[0, 0] = min(set(range(n_experts)) - set(experts[0].tolist()))
    return wrong


def wrong_topk():
    """For the step: the split model's routers (moe/layer.py's `route`; the reference's is
    moe/reference.py's own import) give each rank's first token, as its first choice, the expert
    it scores lowest: its own top-k when the reference's is imposed, else the experts it uses."""
    real = moe_layer.route

    def planted(logits, cfg, bias=None, imposed=None):
        r = real(logits, cfg, bias, imposed)
        if not logits.shape[0]:
            return r
        which = "experts" if r.own is None else "own"
        chosen = getattr(r, which).clone()
        scores = (r.probs if cfg.router_pre_softmax else logits)[0].detach()
        chosen[0, 0] = next(int(e) for e in scores.argsort() if int(e) not in chosen[0].tolist())
        return dataclasses.replace(r, **{which: chosen})
    return patched(moe_layer, "route", planted)
