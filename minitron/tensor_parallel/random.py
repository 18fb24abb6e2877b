"""Dropout masks that agree, element for element, with the single-device model.

Megatron gives each tensor-parallel rank its own seed for dropout inside the TP region,
which is fast but makes the masks differ from any single-device run. minitron wants to
check every number, so it takes the exact route: all ranks of a TP group advance one
generator in lock-step, every rank draws the *full* mask, and each keeps its own slice
(its heads, or its part of the sequence under sequence parallelism). The single-device
reference draws the same full masks in the same order, so mask k of the parallel run is
mask k of the reference. The cost is RNG work, never communication.
"""
from __future__ import annotations

import torch


class DropoutRNG:
    """One generator shared (by seed) across a TP group and the reference model."""

    def __init__(self, seed: int = 1234, device: torch.device | str = "cpu"):
        self.seed = seed
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    def reset(self, seed: int | None = None) -> None:
        """Start the mask sequence again (call it at the start of every step on every rank)."""
        self.generator.manual_seed(self.seed if seed is None else seed)

    def keep_mask(self, shape, p: float) -> torch.Tensor:
        """The full boolean keep-mask for `shape`; identical on every rank that calls it."""
        return torch.rand(shape, generator=self.generator, device=self.device) >= p

    def dropout(self, x: torch.Tensor, p: float, training: bool, index=None,
                full_shape=None) -> torch.Tensor:
        """Inverted dropout. `index` picks this rank's slice of a mask of `full_shape`."""
        if not training or p == 0.0:
            return x
        mask = self.keep_mask(full_shape or x.shape, p)
        if index is not None:
            mask = mask[index]
        return x * mask.to(x.dtype) / (1.0 - p)
