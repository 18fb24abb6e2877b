"""The pieces of ParallelGPT that run on minitron's fused Triton kernels.

ModelConfig(use_kernels=True) swaps in the fused Triton kernels of minitron.kernels, with the
same parameters (so state dicts shard unchanged) and the same numbers up to float32 rounding:

  *_norm                ops.layer_norm / ops.rms_norm (FusedLayerNorm / FusedRMSNorm)
  attention core        ops.flash_attention (causal, GQA inside the kernel) when no dropout;
                        with dropout, q k^T then ops.scaled_masked_softmax, the reference's
                        dropout mask, then @ v; GQA by broadcasting k and v, never copying them
  mlp                   ops.swiglu on the [gate; up] halves; ops.bias_gelu adding fc1's bias
                        (fc1 skips its bias add); plain F.gelu when there are no biases
  loss                  ops.vocab_parallel_cross_entropy (two all-reduces instead of three)

Embeddings, rotary positions, the linear layers and residual dropout stay torch. Where the
kernels cannot run (CPU ranks without TRITON_INTERPRET=1 set before triton's first import, or
no triton), construction raises a ValueError saying what to do rather than quietly running
ops' torch twins: a check against the reference would then pass without running one kernel.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn as nn

from ..kernels import ops   # imports no triton until a kernel first runs
from ..runtime.process_group import pick_backend
from ..tensor_parallel.random import DropoutRNG
from ..config import ModelConfig
from .reference import make_norm

FLASH_HEAD_DIMS = (16, 32, 64, 128, 256)   # what kernels/flash_attention.py compiles for


class FusedLayerNorm(nn.LayerNorm):
    """nn.LayerNorm's parameters and state dict; the fused kernel's forward and backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.layer_norm(x, self.weight, self.bias, self.eps)


class FusedRMSNorm(nn.RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


def make_model_norm(cfg: ModelConfig) -> nn.Module:
    """The reference's norm, or its fused twin (same parameters) when cfg.use_kernels."""
    if not cfg.use_kernels:
        return make_norm(cfg)
    return (FusedRMSNorm if cfg.norm == "rmsnorm" else FusedLayerNorm)(cfg.hidden, eps=cfg.norm_eps)


def kernels_problem(device: torch.device) -> str | None:
    """Why minitron.kernels cannot run on `device` tensors in this process; None if they can.

    ops runs a kernel on CUDA tensors, or on CPU tensors under Triton's interpreter; otherwise
    it quietly takes the torch twin. triton.jit picks interpreter or compiler when it decorates
    a function, i.e. when triton and each kernel module are first imported: later is too late.
    """
    fix = ("set TRITON_INTERPRET=1 in the environment before triton is first imported "
           "(the kernels then run, slowly, on the CPU)")
    if device.type != "cuda" and not ops.interpreting():
        return f"{device} tensors need a CUDA device or Triton's interpreter: {fix}"
    if not ops.available():
        return "triton is not installed (pip install triton)"
    compiled = [name for name, mod in list(sys.modules.items())
                if (name == "triton.language.standard" or name.startswith("minitron.kernels."))
                and any(type(v).__name__ == "JITFunction" for v in vars(mod).values())]
    if device.type != "cuda" and compiled:
        return (f"{', '.join(compiled)} were imported before TRITON_INTERPRET=1 was set, so "
                f"triton.jit compiled them for a GPU: {fix}")
    return None


def check_kernels(cfg: ModelConfig, device: torch.device) -> None:
    """ValueError, saying what to change, unless ParallelGPT(cfg) can run its kernels on `device`."""
    problem = kernels_problem(device)
    if problem:
        raise ValueError(f"ModelConfig(use_kernels=True): {problem}; or set use_kernels=False")
    if cfg.head_dim not in FLASH_HEAD_DIMS:
        raise ValueError(f"use_kernels: flash attention takes head_dim in {FLASH_HEAD_DIMS}, "
                         f"got hidden/n_heads = {cfg.head_dim}: change hidden or n_heads")


def fused_attention_core(q, k, v, cfg: ModelConfig, rng: DropoutRNG, training: bool,
                         head_index: slice, full_heads: int) -> torch.Tensor:
    """reference.attention_core through the kernels, for q [b, hq, s, d], k/v [b, hkv, s, d]."""
    scale = cfg.head_dim ** -0.5
    if cfg.dropout == 0.0 or not training:       # no mask to apply: the scores never exist
        return ops.flash_attention(q, k, v, causal=True, scale=scale)
    # Dropout needs the probabilities themselves (flash attention never stores them), so
    # the mask can be the reference's. Query head i reads kv head i // group: view q as
    # [b, hkv, group, s, d] and let k, v broadcast over the group dimension.
    b, hq, s, d = q.shape
    hkv = k.shape[1]
    q5 = q.reshape(b, hkv, hq // hkv, s, d)
    scores = (q5 @ k.unsqueeze(2).transpose(-2, -1)).reshape(b, hq, s, s)
    probs = ops.scaled_masked_softmax(scores, scale, causal=True)
    probs = rng.dropout(probs, cfg.dropout, training, index=(slice(None), head_index),
                        full_shape=(b, full_heads, s, s))   # drawn as attention_core draws it
    return (probs.reshape(b, hkv, hq // hkv, s, s) @ v.unsqueeze(2)).reshape(b, hq, s, d)


def enable_kernels(mcfg: ModelConfig, world_size: int) -> str:
    """Make minitron.kernels runnable on the ranks launch() will start; say how they run.

    Ranks on GPUs run the compiled kernels. Ranks on the CPU need Triton's interpreter, which
    triton.jit picks when triton is first imported: so TRITON_INTERPRET=1 goes into this
    process's environment here, before anything imports triton, and the forked ranks inherit
    it. Raises ValueError (before any rank starts) where the kernels still cannot run.
    """
    if pick_backend(world_size) == "nccl":
        check_kernels(mcfg, torch.device("cuda"))
        return "kernels=compiled Triton on the GPUs"
    os.environ["TRITON_INTERPRET"] = "1"
    check_kernels(mcfg, torch.device("cpu"))   # e.g. triton already imported without it
    return ("kernels=Triton interpreter on the CPU (TRITON_INTERPRET=1, set before "
            "the ranks start: no GPU per rank)")
