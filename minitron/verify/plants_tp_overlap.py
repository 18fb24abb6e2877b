"""The tensor-parallel plant tp-overlap-chunk (plants.py): the overlapped ring all-gather of
tensor_parallel/overlap.py files each chunk it receives under the wrong rank."""
from __future__ import annotations


def misfiled(ring_gather):
    """tp-overlap-chunk: overlap.ring_gather that files each chunk under the rank before the one
    that sent it (compute(j - 1, x_j) instead of compute(j, x_j))."""
    def planted(x, group, compute, what):
        return ring_gather(x, group, lambda j, x_j: compute((j - 1) % group.size, x_j), what)
    return planted
