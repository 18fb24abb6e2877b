"""The FP8 linear layer: y = x W^T + b with both GEMM operands cast to FP8 (fp8.py), and the
backward's output gradient too.

    forward    y  = (q_x q_w^T) / (s_x s_w) + b          q_x = E4M3(x s_x), q_w = E4M3(W s_w)
    backward   dx = (q_g q_w) / (s_g s_w)                 q_g = E5M2(dy s_g)
               dW = (q_g^T q_x) / (s_g s_x)               db = sum of dy (unquantized)

The GEMMs multiply FP8 numbers and accumulate in float32, then rescale once and round to the
activations' dtype (bf16). On a CPU this is emulated exactly: the FP8 tensors are widened to
float32 (every FP8 value is a float32 value, and a product of two fits float32's 24 bits) and
multiplied there, so the result is what an FP8 GEMM with float32 accumulation gives, up to
the order of the sum. On a GPU with FP8 tensor cores (compute capability 8.9+: Ada, Hopper,
Blackwell) the same GEMM is torch._scaled_mm. The input and weight casts are saved for the
backward (the FP8 copies, 1 byte per element, not the bf16 tensors).

Each rank casts its own pieces (a column shard of W, its slice of x's features in a
row-parallel layer, its rows and sequence chunks), but with the whole logical tensor's scale:
each amax is all-reduced (max) over the grid's amax group before a scale is taken from it
(fp8.py, "Amax reduction"; enable_fp8's `group`), as Megatron-Core has Transformer Engine do,
so every cast is the one a single device makes. FP8Recipe(reduce_amax=False) leaves each rank
its own amaxes: a finer scale per piece, and casts no single device makes.

Which layers: every GEMM of the transformer blocks (qkv, attention out, fc1, fc2). The
embedding (a lookup: no GEMM to speed up) and the output layer stay bf16, as in Megatron-LM
with Transformer Engine: the logits feed a softmax over the whole vocabulary, where an E4M3
error of 6% in the largest logits moves the probabilities themselves, and the LM head's
gradient is the loss's gradient, largest in dynamic range (NVIDIA's FP8 guidance keeps both).
The master weights and Adam states are the bf16 run's: fp32, in the optimizer.

The fine-grained recipes (blockwise, mxfp8: a scale per block, E4M3 for every operand) go
through fp8_blocks.py's own GEMM instead: each rank casts its local tensors block by block, no
amax is reduced, and the GEMM multiplies the dequantized operands in float32 (on a GPU too:
torch._scaled_mm's block-scaled modes are not used here); with --tp-comm-overlap, through
fp8_blocks.BlockRingGemms.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from . import weight_grad
from .fp8 import E4M3, E5M2, FP8Recipe, TensorScaler, quantize
from .fp8_blocks import BlockRingGemms, BlockScaler, block_linear
from .layers import ColumnParallelLinear, RowParallelLinear
from .overlap import RingGemms

KEEP_BF16 = ("lm_head",)          # module names never cast to FP8 (the docstring says why)
SCALERS = ("input", "weight", "grad")


class FP8State:
    """One layer's three scalers (input, weight, output gradient), and the GEMM that uses them:
    a layer holding a state calls state.linear(x, weight, bias) instead of F.linear."""

    def __init__(self, recipe: FP8Recipe, group=None):
        self.recipe = recipe
        if recipe.fine_grained:      # a scale per block, E4M3 throughout, nothing reduced (fp8_blocks.py)
            self.input, self.weight, self.grad = (BlockScaler(E4M3, recipe) for _ in SCALERS)
            return
        self.input = TensorScaler(E4M3, recipe, group)
        self.weight = TensorScaler(E4M3, recipe, group)
        self.grad = TensorScaler(E5M2, recipe, group)

    def scalers(self) -> tuple[TensorScaler, ...]:
        return self.input, self.weight, self.grad

    def state_dict(self) -> dict:
        return {name: s.state_dict() for name, s in zip(SCALERS, self.scalers())}

    def load_state_dict(self, state: dict) -> None:
        for name, s in zip(SCALERS, self.scalers()):
            s.load_state_dict(state[name])

    def ring_gemms(self) -> RingGemms:
        """The GEMMs of --tp-comm-overlap's rings (overlap.py), cast as `linear` casts."""
        if self.recipe.fine_grained:
            return BlockRingGemms(self, dequantized_matmul)
        return FP8RingGemms(self)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.recipe.fine_grained:
            return block_linear(x, weight, bias, self, dequantized_matmul)
        return fp8_linear(x, weight, bias, self)


def scaled_matmul(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """(a b) / (a_scale b_scale) for FP8 matrices a [m, k] and b [k, n], accumulated in float32."""
    if a.is_cuda and a.dtype in (E4M3, E5M2) and gpu_has_fp8(a.device):
        # _scaled_mm wants a row-major, b column-major, and the inverse scales (float32 scalars)
        return torch._scaled_mm(a.contiguous(), b.t().contiguous().t(), scale_a=a_scale.reciprocal(),
                                scale_b=b_scale.reciprocal(), out_dtype=out_dtype)
    return (a.float() @ b.float() * (a_scale * b_scale).reciprocal()).to(out_dtype)


def dequantized_matmul(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a b for float32 matrices (block-scaled FP8 operands, dequantized: fp8_blocks.py), in
    float32, rounded once to out_dtype: scaled_matmul with unit scales, looked up when called."""
    one = torch.ones((), device=a.device)
    return scaled_matmul(a, one, b, one, out_dtype)


def gpu_has_fp8(device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 9)


class ScaleTape:
    """The scales of one recomputed region's FP8 GEMMs (model/recompute.py), Transformer Engine's
    way: its first forward records the (input, weight) scales it cast with; the rerun in backward
    replays them, so the rerun casts exactly as the first forward did and records no amax twice
    (a delayed-scaling history stays one entry per use). The fine-grained recipes never reach
    it: their scales are their blocks' own amaxes' and keep no history, so the rerun's casts of
    its bitwise-identical inputs are the first forward's."""
    active: "ScaleTape | None" = None

    def __init__(self):
        self.scales: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.replaying: int | None = None

    def scales_for(self, x, weight, state: FP8State):
        if self.replaying is not None:
            self.replaying += 1
            return self.scales[self.replaying - 1]
        pair = state.input.scale_for(x).clone(), state.weight.scale_for(weight).clone()
        self.scales.append(pair)
        return pair

    @contextlib.contextmanager
    def recording(self):
        yield from self._as_active(None)

    @contextlib.contextmanager
    def replay(self):
        yield from self._as_active(0)

    def _as_active(self, replaying):
        before, ScaleTape.active, self.replaying = ScaleTape.active, self, replaying
        try:
            yield self
        finally:
            ScaleTape.active, self.replaying = before, None


def forward_scales(x: torch.Tensor, weight: torch.Tensor, state: FP8State):
    """The (input, weight) scales of a forward GEMM: the scalers' (one use recorded each), or,
    inside a recomputed region's rerun, the ones its first forward took (ScaleTape)."""
    tape = ScaleTape.active
    if tape is not None:
        return tape.scales_for(x, weight, state)
    return state.input.scale_for(x), state.weight.scale_for(weight)


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, state: FP8State):
        s_x, s_w = forward_scales(x, weight, state)
        q_x = quantize(x, s_x, E4M3).reshape(-1, x.shape[-1])       # [tokens, in]
        q_w = quantize(weight, s_w, E4M3)                           # [out, in]
        y = scaled_matmul(q_x, s_x, q_w.t(), s_w, x.dtype).reshape(*x.shape[:-1], -1)
        ctx.save_for_backward(q_x, q_w, s_x, s_w)
        ctx.state, ctx.has_bias, ctx.dtypes = state, bias is not None, (x.dtype, weight.dtype)
        ctx.params = (weight, bias) if weight_grad.STORE.capturing else None   # may defer dL/dW
        return y + bias if bias is not None else y

    @staticmethod
    def backward(ctx, dy):
        q_x, q_w, s_x, s_w = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        g = dy.reshape(-1, dy.shape[-1])                            # [tokens, out]
        s_g = ctx.state.grad.scale_for(g)
        q_g = quantize(g, s_g, E5M2)
        dx = scaled_matmul(q_g, s_g, q_w, s_w, x_dtype).reshape(*dy.shape[:-1], -1)

        def weight_grads():      # the W of a zero-bubble schedule: the same FP8 GEMM, later
            return scaled_matmul(q_g.t(), s_g, q_x, s_x, w_dtype), g.sum(0) if ctx.has_bias else None
        if ctx.params is not None and weight_grad.defer(ctx.params, weight_grads,
                                                        q_g.numel() * q_g.element_size()):
            return dx, None, None, None
        return (dx, *weight_grads(), None)


class FP8RingGemms(RingGemms):
    """_FP8Linear's three GEMMs, one chunk of the sequence at a time (overlap.py's rings).

    The scales are taken once per call, before the ring starts, from this rank's piece (its
    sequence chunk, or its features): the amax is all-reduced over the amax group, which holds
    the tp ranks, so it is the whole logical tensor's amax and the scale the unchunked layer
    takes; a delayed history records one use, as there. Every cast is elementwise, so each
    chunk's FP8 numbers are the unchunked cast's; dL/dW sums its chunks' float32 products in
    float32 and is rounded once, as one GEMM accumulating in float32 is."""
    wgrad_dtype = torch.float32

    def __init__(self, state: FP8State):
        if state.recipe.fine_grained:
            raise ValueError(f"FP8RingGemms takes one scale per tensor: the {state.recipe.scaling} "
                             "recipe's rings are fp8_blocks.BlockRingGemms (FP8State.ring_gemms)")
        self.state = state

    def begin_forward(self, x, weight):
        self.s_x, self.s_w = forward_scales(x, weight, self.state)
        self.q_w, self.dtype = quantize(weight, self.s_w, E4M3), x.dtype

    def begin_backward(self, dy):
        self.s_g = self.state.grad.scale_for(dy.reshape(-1, dy.shape[-1]))

    def forward(self, x, weight):
        q_x = quantize(x, self.s_x, E4M3).reshape(-1, x.shape[-1])
        return scaled_matmul(q_x, self.s_x, self.q_w.t(), self.s_w, self.dtype).reshape(*x.shape[:-1], -1)

    def dgrad(self, dy, weight):
        q_g = quantize(dy, self.s_g, E5M2).reshape(-1, dy.shape[-1])
        return scaled_matmul(q_g, self.s_g, self.q_w, self.s_w, self.dtype).reshape(*dy.shape[:-1], -1)

    def wgrad(self, dy, x):
        q_g = quantize(dy, self.s_g, E5M2).reshape(-1, dy.shape[-1])
        q_x = quantize(x, self.s_x, E4M3).reshape(-1, x.shape[-1])
        return scaled_matmul(q_g.t(), self.s_g, q_x, self.s_x, torch.float32)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               state: FP8State) -> torch.Tensor:
    """F.linear(x, weight, bias) with FP8 GEMMs (module docstring); `state` holds the scales."""
    return _FP8Linear.apply(x, weight, bias, state)


def enable_fp8(model: nn.Module, recipe: FP8Recipe, group=None) -> list[str]:
    """Give every tensor-parallel linear layer of the blocks an FP8State (the others, KEEP_BF16,
    stay as they are), its amaxes reduced over `group` (the grid's amax group, tp x cp x ep x dp,
    unless recipe.reduce_amax is off); returns the names of the layers now in FP8."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) \
                and name.split(".")[-1] not in KEEP_BF16:
            module.fp8 = FP8State(recipe, group)
            names.append(name)
    return names


def fp8_states(model: nn.Module) -> list[FP8State]:
    return [m.fp8 for m in model.modules() if getattr(m, "fp8", None) is not None]


def named_fp8_states(model: nn.Module) -> dict[str, FP8State]:
    """{layer name: its FP8State}; ParallelGPT's and the reference's (GPT.enable_fp8) names agree:
    layers.{i}.attention.qkv / .out, layers.{i}.mlp.fc1 / .fc2."""
    out = {}
    for name, m in model.named_modules():
        state = getattr(m, "fp8", None)
        if isinstance(state, FP8State):
            out[name] = state
        elif isinstance(state, dict):           # the reference: one module, several GEMMs
            out.update({f"{name}.{k}": v for k, v in state.items()})
    return out


def fp8_state_dict(model: nn.Module) -> dict:
    """Every FP8 layer's amax histories, scales and uses (a checkpoint's "fp8" entry)."""
    return {name: s.state_dict() for name, s in named_fp8_states(model).items()}


def load_fp8_state_dict(model: nn.Module, state: dict) -> None:
    states = named_fp8_states(model)
    if states.keys() != state.keys():
        raise ValueError(f"the checkpoint's FP8 layers {sorted(state)[:4]}... are not this model's "
                         f"{sorted(states)[:4]}...: was it saved with the same --dtype fp8 model?")
    for name, s in states.items():
        s.load_state_dict(state[name])


__all__ = ["FP8State", "FP8RingGemms", "ScaleTape", "KEEP_BF16", "SCALERS", "scaled_matmul", "dequantized_matmul",
           "gpu_has_fp8", "fp8_linear", "enable_fp8", "fp8_states", "named_fp8_states", "fp8_state_dict", "load_fp8_state_dict"]
