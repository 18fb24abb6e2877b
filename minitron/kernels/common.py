"""What ops.py and the kernel files share. A leaf: it imports neither, so neither imports the other.

``POISON = True`` makes every buffer a kernel writes start out full of NaN, so an element a
kernel forgets to write shows up in the comparison instead of silently holding whatever the
allocator left there (tests/test_kernels.py turns it on).
"""
import os

import torch

POISON = False


def alloc(shape, dtype, device):
    """Every kernel output goes through here (see POISON)."""
    if POISON:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def interpreting():
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def global_softmax_stats(row_max, sumexp, target_logit, allreduce_max, allreduce_sum):
    """The two collectives of vocab-parallel cross entropy, shared by both paths.

    From each shard's (row max, sum of exp at that max, target logit or 0) to the global
    (M, log S, x_target - M), S = sum_j exp(x_j - M). All ranks agree on M first, so that
    the sums of exp can be rescaled to it and added; the target logits are added raw
    (one rank's value plus zeros: exact) and shifted by M only then."""
    global_max = row_max.clone()
    allreduce_max(global_max)
    stats = torch.stack([sumexp * torch.exp(row_max - global_max), target_logit])
    allreduce_sum(stats)
    return global_max, torch.log(stats[0]), stats[1] - global_max
