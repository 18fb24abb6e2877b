"""Aux-loss-free load balancing (DeepSeek-V3, Wang et al. 2024): the per-expert bias and the
load it is updated from, after every optimizer step.

Each MoE layer's router adds a bias b_e to its scores for choosing the top k (router.route);
the gates stay those of the unbiased scores, so b steers load without a gradient. After each
optimizer step b_e += gamma * sign(mean load - load_e) (router.update_expert_bias), where
load_e counts the tokens that chose e over the whole step: every micro-batch since the last
update, on every rank that holds other tokens of the batch. Those are the ranks of
ParallelMoE.load_groups(): dense_dp (dp x ep x cp), and tp under sequence parallelism (each tp
rank routes its own slice of the sequence); pipeline ranks hold other layers, not other
tokens, so each stage updates its own layers. The counts are summed by `reduce_loads`, one
all-reduce of [layers, E] int64 per group through runtime.comm (counted): every rank holding a
layer then applies the same integers to the same bias, and a split run's biases equal one
device's bit for bit. Counts from this rank alone would balance each replica's share of the
batch and drift the replicas apart (verify's plant moe-local-load).

Why float32: bfloat16's spacing is 2^-9 (2e-3) for |b| in [0.25, 0.5) and 2^-8 from 0.5, so a
16-bit bias would take each step gamma = 1e-3 as a whole spacing there (doubled), then not at
all (rounded away). The bias stays float32 when the
model is cast (`ExpertBias._apply`; Megatron-Core keeps it in float32 too), and `route` adds it
to the scores in float32. It is not in the state dict (no gradient, no optimizer state): the
checkpoints save it by itself (train/checkpoint_bias.py).

The loads are counted in training forwards only (module.training and autograd on): an
evaluation or a sample does not move the bias. A step whose update a float16 loss scaler skips
still updates the bias (its counts are real; Megatron-Core updates it in finalize_model_grads,
before the optimizer's verdict).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..runtime import comm
from .router import update_expert_bias


class ExpertBias(nn.Module):
    """What an MoE layer (moe/layer.py's ParallelMoE, moe/reference.py's MoE) needs for the
    bias: the float32 buffer `expert_bias` (None unless cfg.expert_bias), `step_load` (this
    rank's tokens per expert since the last update) and `load_groups` (the ranks holding the
    other tokens: none on one device)."""

    def _init_expert_bias(self, cfg) -> None:
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts) if cfg.expert_bias else None,
                             persistent=False)
        self.step_load: torch.Tensor | None = None

    def record_load(self, counts: torch.Tensor) -> None:
        """Add this forward's tokens per expert [E] (this rank's, before any reduction)."""
        if self.expert_bias is None or not (self.training and torch.is_grad_enabled()):
            return
        self.step_load = counts.detach().clone() if self.step_load is None else self.step_load + counts

    def load_groups(self) -> list:
        return []

    def _apply(self, fn, recurse=True):
        bias = self.expert_bias
        super()._apply(fn, recurse)
        if bias is not None:                   # moved with the module, never cast (docstring)
            self.expert_bias = bias.to(device=self.expert_bias.device)
        return self


def reduce_loads(loads: torch.Tensor, groups) -> torch.Tensor:
    """Sum [layers, E] counts over every group in turn (in place, counted by runtime.comm)."""
    for g in groups:
        loads = comm.all_reduce(loads, g)
    return loads


def update_biases(layers) -> torch.Tensor | None:
    """After an optimizer step: sum each layer's load over its load_groups, move its bias by
    +-cfg.bias_update_rate, start a new count. `layers`: this rank's MoE layers (a model's
    moe_layers()). Returns the summed loads [layers, E] (None: no layer has a bias).
    Collective over the load groups: every rank holding the layers calls it, every step."""
    layers = [m for m in layers if m.expert_bias is not None]
    if not layers:
        return None
    E = layers[0].cfg.n_experts
    device = layers[0].expert_bias.device
    loads = torch.stack([torch.zeros(E, dtype=torch.int64, device=device) if m.step_load is None
                         else m.step_load.to(device=device, dtype=torch.int64) for m in layers])
    loads = reduce_loads(loads, layers[0].load_groups())   # module attribute: a plant replaces it
    for m, load in zip(layers, loads):
        update_expert_bias(m.expert_bias, load, m.cfg.bias_update_rate)
        m.step_load = None
    return loads


def moe_by_layer(model) -> dict[int, ExpertBias]:
    """{global layer index: MoE layer} of the layers this rank holds (a GPT's ModuleList or a
    PipelineGPT's ModuleDict keyed by the global index)."""
    items = model.layers.items() if hasattr(model.layers, "items") else enumerate(model.layers)
    return {int(i): block.mlp for i, block in items if isinstance(getattr(block, "mlp", None), ExpertBias)}
