"""The one rule from a precision's name to what a run holds (train/engine.py TrainingRun).

    float32, float64        the model in that dtype, torch's AdamW or ZeroOptimizer on it
    bfloat16, float16       16-bit weights, activations and gradients; fp32 master weights and
                            Adam moments in the optimizer; float16 with a loss scaler
    fp8                     bfloat16 training whose block GEMMs cast their operands to FP8
                            (tensor_parallel/fp8_linear.py), by a recipe (--fp8-recipe)

The command lines (train, verify, bench precision) and the engine read it from here; what FP8
does not run with is in minitron/refusals/.
"""
from __future__ import annotations

import torch

from ..tensor_parallel.fp8 import FP8Recipe

SIXTEEN_BIT = (torch.bfloat16, torch.float16)
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}
PRECISIONS = (*DTYPES, "fp8")      # what --dtype takes


def resolve_precision(name: str, fp8_recipe: str | None = None,
                      amax_reduce: bool = True) -> tuple[torch.dtype, FP8Recipe | None]:
    """--dtype NAME [--fp8-recipe R] [--no-fp8-amax-reduce] -> (the weights' and activations'
    dtype, the FP8 recipe; delayed scaling unless R says otherwise, amaxes reduced over tp x cp x
    dp unless amax_reduce is False: tensor_parallel/fp8.py).

    fp8 is bf16 training with FP8 GEMMs: the weights, activations and the gradients between
    layers stay bf16, the optimizer keeps fp32 masters and moments, and each GEMM of the
    blocks casts its operands to FP8 on the way in (tensor_parallel/fp8_linear.py)."""
    if name == "fp8":
        return torch.bfloat16, FP8Recipe(fp8_recipe or "delayed", reduce_amax=amax_reduce)
    if not amax_reduce:
        raise ValueError("--no-fp8-amax-reduce keeps each rank's own FP8 amaxes, which only --dtype "
                         "fp8 has: add --dtype fp8, or drop --no-fp8-amax-reduce")
    if fp8_recipe is not None:
        raise ValueError(f"--fp8-recipe {fp8_recipe} chooses the scales of FP8 GEMMs, which only "
                         f"--dtype fp8 has: add --dtype fp8, or drop --fp8-recipe")
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r}: choose one of {', '.join(PRECISIONS)}")
    return DTYPES[name], None
