"""Dropout masks that agree, element for element, with the single-device model.

Megatron gives each tensor-parallel rank its own seed for dropout inside the TP region,
which is fast but makes the masks differ from any single-device run. minitron wants to
check every number, so it takes the exact route: all ranks of a TP group advance one
generator in lock-step, every rank draws the *full* mask, and each keeps its own slice
(its heads, or its part of the sequence under sequence parallelism). The single-device
reference draws the same full masks in the same order, so mask k of the parallel run is
mask k of the reference. The cost is RNG work, never communication.

Masks are drawn on the device of the tensor they mask, from one generator per device,
all seeded alike, so a model moved with `.to(device)` keeps working. CPU and CUDA
generators produce different streams: compare a parallel run with a reference on the
same kind of device.
"""
from __future__ import annotations

import torch


class DropoutRNG:
    """One generator stream shared (by seed) across a TP group and the reference model."""

    def __init__(self, seed: int = 1234, device: torch.device | str = "cpu"):
        self.seed = seed
        self.device = torch.device(device)   # where keep_mask draws when not told otherwise
        self._current_seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device not in self._generators:
            gen = torch.Generator(device=device)
            gen.manual_seed(self._current_seed)
            self._generators[device] = gen
        return self._generators[device]

    def reset(self, seed: int | None = None) -> None:
        """Start the mask sequence again (call it at the start of every step on every rank)."""
        self._current_seed = self.seed if seed is None else seed
        for gen in self._generators.values():
            gen.manual_seed(self._current_seed)

    def keep_mask(self, shape, p: float, device: torch.device | str | None = None) -> torch.Tensor:
        """The full boolean keep-mask for `shape`; identical on every rank that calls it."""
        device = torch.device(device) if device is not None else self.device
        return torch.rand(shape, generator=self._generator(device), device=device) >= p

    def dropout(self, x: torch.Tensor, p: float, training: bool, index=None,
                full_shape=None) -> torch.Tensor:
        """Inverted dropout. `index` picks this rank's slice of a mask of `full_shape`."""
        if not training or p == 0.0:
            return x
        mask = self.keep_mask(full_shape or x.shape, p, device=x.device)
        if index is not None:
            mask = mask[index]
        return x * mask.to(x.dtype) / (1.0 - p)
