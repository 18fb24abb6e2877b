"""Fused Triton kernels for minitron, each with a pure-torch fallback.

Import the ops from here; nothing in this package imports triton until a
kernel actually runs, so this works on any machine (see ops.available()).
"""
from .ops import (  # noqa: F401
    available,
    bias_gelu,
    cross_entropy,
    flash_attention,
    fused_adamw_step,
    layer_norm,
    merge_vocab_parallel_partials,
    rms_norm,
    scaled_masked_softmax,
    swiglu,
    use_triton,
    vocab_parallel_ce_partials,
    vocab_parallel_cross_entropy,
)

__all__ = [
    "available", "use_triton", "rms_norm", "layer_norm", "scaled_masked_softmax",
    "flash_attention", "cross_entropy", "vocab_parallel_cross_entropy",
    "vocab_parallel_ce_partials", "merge_vocab_parallel_partials", "swiglu", "bias_gelu",
    "fused_adamw_step",
]
