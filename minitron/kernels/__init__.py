"""Fused Triton kernels for minitron, each with a pure-torch fallback.

Call the ops through `minitron.kernels.ops` (or import them from here); nothing in this
package imports triton until a kernel actually runs, so this works on any machine (see
ops.available()). `flash_attention` and `cross_entropy` are not re-exported here: those
names are the kernels' own modules (flash_attention.py, cross_entropy.py), and a function
of the same name would be replaced by the module the first time it is imported.
"""
from . import ops  # noqa: F401
from .ops import (  # noqa: F401
    available,
    bias_gelu,
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
    "ops", "available", "use_triton", "rms_norm", "layer_norm", "scaled_masked_softmax",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_ce_partials", "merge_vocab_parallel_partials", "swiglu", "bias_gelu",
    "fused_adamw_step",
]
