"""The context-parallel plant cp-no-rescale (plants.py): ring attention's blocks summed without
the online softmax's rescale. (cp-chunk-order needs no code of its own: Plant.cp_layout.)"""
from __future__ import annotations

import contextlib

import torch

from ..context_parallel.blocks import Accumulator


@contextlib.contextmanager
def merged_without_rescale():
    """Inside the block, context_parallel.blocks.Accumulator sums the blocks' outputs as they
    come, without the exp(lse_block - lse) rescale of the online softmax (a planted bug)."""
    def unscaled(self, rows, out_b, lse_b):
        lse = self.lse[:, :, rows]
        self.out[:, :, rows].add_(out_b)
        lse.copy_(torch.logaddexp(lse, lse_b.to(lse.dtype)))
    merge, Accumulator.merge = Accumulator.merge, unscaled
    try:
        yield
    finally:
        Accumulator.merge = merge
