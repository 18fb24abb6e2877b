"""FP8 GEMMs of the experts: the local experts' GEMMs in one call, each expert with its own scales.

An MoE layer's expert GEMM is E_local independent GEMMs (moe/experts.py's StackedLinear: weight
[E_local, out, in]; the rows x [m, in] sorted by expert, counts[e] of them for expert e). In FP8
each is the dense FP8 linear of fp8_linear.py: E4M3 input and weight, E5M2 output gradient,
float32 accumulation, one rescale. What is per expert is the scaling: expert e's weight and
its tokens are tensors of their own, so each expert has its own three scalers (input, weight,
output gradient; an ExpertState), as Transformer Engine's grouped GEMM keeps one set of scales
per GEMM of the group. One scale over all experts would let the largest expert's amax set the
grid of all the others, casts no single device makes expert by expert.

Which ranks hold one expert's tensors, so whose amaxes make the logical one (the one device's):
  weight   expert e lives on ep rank e // E_local, split inside by tp (fc1 by columns, fc2 by
           rows) and replicated over dp x cp: its amax is the max over tp (the replicas agree).
  input    the dispatcher (moe/dispatch.py) brings every token of this dp x cp replica that chose
           e, from every rank of tp x ep, to e's rank: after dispatch the expert's rank holds
           all of them, so its local amax already is the replica's, whatever ep is. What it does
           not see are the other replicas' tokens (dp, cp: other rows and chunks of the batch),
           and for fc2 the other tp ranks' columns of the activation.
  grad     the same tokens, the same split (fc2's output gradient is whole on every tp rank,
           fc1's is split by columns).
So an expert's amax is reduced (max) over tp, then over dp x cp (the grid's dp_cp: the ranks that
hold the same experts): the amax group without ep. Not over ep: another ep rank's scaler i is
another expert's, and a max over it would mix two experts' amaxes. Padded rows are zeros and do
not change an amax; an expert without tokens has amax 0 (keeps its previous scale, fp8.py).
A dp or cp rank's gradients are those of its own mean loss, dense_dp times the whole batch's
(a power of 2), as for the dense layers: the same casts.

The GEMM. On a CPU (emulation) and on a GPU alike, each expert's real rows (counts[e] of them)
are one FP8 GEMM, fp8_linear.scaled_matmul, the dense layer's: the group is computed exactly as
a loop of the dense FP8 linear over the experts would compute it (tests/test_fp8_experts.py).
On an FP8 GPU torch._scaled_mm wants dimensions
that are multiples of 16, so each expert's rows are padded with zero rows up to one (zeros add
nothing to a product, an amax or a weight gradient), as `expert_linear` does for one expert.

The fine-grained recipes (blockwise: 1 x 128 tiles of the tokens, 128 x 128 weight blocks;
mxfp8: 32-element blocks with E8M0 scales; fp8_blocks.py). A scale per block is an expert's own
by construction (a block never spans two experts: each expert's rows and weight are separate
GEMM operands), so each expert's real rows run through the dense layer's block-scaled linear
with that expert's three BlockScalers, expert_linear itself: the same quantizers, the same tiles
along each GEMM's K, the same float32 GEMM of the dequantized operands (DeepSeek-V3's promotion
every 128 products, exactly). No amax is reduced: a block lies whole on the rank that casts it.

Recomputation (model/recompute.py): the group's (input, weight) scales are one entry of the
ScaleTape, replayed by the rerun. The weight gradients are computed in the backward, as the
16-bit experts' are (their F.linear's): zero-bubble schedules defer the dense layers' W only.
Checkpoints and the verifier find the scalers through named_fp8_states: a StackedLinear's `fp8`
is an ExpertStates, a dict {global expert index: ExpertState}, named layer.{e}.
"""
from __future__ import annotations

import contextlib

import torch

from ..runtime import comm
from . import fp8_linear as dense, weight_grad
from .fp8 import E4M3, E5M2, FP8Recipe, TensorScaler, quantize


class ExpertScaler(TensorScaler):
    """A TensorScaler whose amax is reduced over several groups in turn (tp, then dp x cp), and
    that can be handed an amax already reduced (scale_for_amax: the group's amaxes are taken,
    and reduced, all at once). An empty tensor (an expert without tokens) has amax 0."""

    def __init__(self, fmt: torch.dtype, recipe: FP8Recipe, groups=()):
        super().__init__(fmt, recipe, None)
        self.groups = tuple(groups) if recipe.reduce_amax else ()
        self._given: torch.Tensor | None = None

    def amax_of(self, x: torch.Tensor) -> torch.Tensor:
        if self._given is not None:
            return self._given
        return reduce_amaxes(amaxes(x.reshape(1, -1)), self.groups)[0]

    def scale_for_amax(self, a: torch.Tensor) -> torch.Tensor:
        self._given = a
        try:
            return self.scale_for(a)
        finally:
            self._given = None


class ExpertState(dense.FP8State):
    """One expert's three scalers of one stacked linear (FP8State's interface and checkpoint);
    under blockwise or mxfp8 the dense layer's BlockScalers (fp8_blocks.py), nothing reduced."""

    def __init__(self, recipe: FP8Recipe, groups=()):
        if recipe.fine_grained:
            return super().__init__(recipe)
        self.recipe = recipe
        self.input = ExpertScaler(E4M3, recipe, groups)
        self.weight = ExpertScaler(E4M3, recipe, groups)
        self.grad = ExpertScaler(E5M2, recipe, groups)


class ExpertStates(dict):
    """{str(global expert index): ExpertState} of one StackedLinear's local experts, in order."""

    def __init__(self, recipe: FP8Recipe, experts: range, groups=()):
        super().__init__({str(e): ExpertState(recipe, groups) for e in experts})
        self.recipe, self.groups = recipe, tuple(groups) if recipe.reduce_amax else ()

    def local(self) -> list[ExpertState]:
        return list(self.values())


def amaxes(x: torch.Tensor) -> torch.Tensor:
    """[E] float32: the amax of each x[e] (x [E, ...]); 0 for an empty one."""
    if x[0].numel() == 0:
        return torch.zeros(x.shape[0], device=x.device)
    return x.detach().abs().reshape(x.shape[0], -1).amax(dim=1).float()


def row_amaxes(x: torch.Tensor, counts) -> torch.Tensor:
    """[E] float32: the amax of each expert's rows of x [m, ...] (counts[e] rows each, in order)."""
    return torch.stack([amaxes(rows[None])[0] for rows in x.split(counts)])


def reduce_amaxes(a: torch.Tensor, groups) -> torch.Tensor:
    for g in groups:
        comm.all_reduce(a, g, op="max")
    return a


def _gemm_rows(n: int, device) -> int:
    """Rows an expert's GEMM runs on: n, or on an FP8 GPU the next multiple of 16 (_scaled_mm)."""
    if device.type == "cuda" and dense.gpu_has_fp8(device):
        return max(16, -(-n // 16) * 16)
    return n


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return t if t.shape[0] == rows else torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def _forward_scales(x: torch.Tensor, weight: torch.Tensor, counts, states: list[ExpertState]):
    """([E] input scales, [E] weight scales): every amax of the group in one reduction; inside a
    recomputed region the ScaleTape records them, and its rerun replays them."""
    tape = dense.ScaleTape.active
    if tape is not None and tape.replaying is not None:
        tape.replaying += 1
        return tape.scales[tape.replaying - 1]
    n = len(states)
    a = reduce_amaxes(torch.cat([row_amaxes(x, counts), amaxes(weight)]), states[0].input.groups)
    s_x = torch.stack([st.input.scale_for_amax(a[e]) for e, st in enumerate(states)])
    s_w = torch.stack([st.weight.scale_for_amax(a[n + e]) for e, st in enumerate(states)])
    if tape is not None:
        tape.scales.append((s_x.clone(), s_w.clone()))
    return s_x, s_w


class _GroupedFP8(torch.autograd.Function):
    """y[rows of e] = FP8 GEMM of x[rows of e] and weight[e] (module docstring), x [m, in]."""

    @staticmethod
    def forward(ctx, x, weight, counts, states):
        s_x, s_w = _forward_scales(x, weight, counts, states)
        fmt_x, fmt_w = states[0].input.fmt, states[0].weight.fmt   # E4M3 (a plant may change them)
        q_w = quantize(weight, s_w[:, None, None], fmt_w)          # [E, out, in]
        ys, q_xs = [], []
        for e, rows in enumerate(x.split(counts)):
            n = rows.shape[0]
            q_x = quantize(_pad_rows(rows, _gemm_rows(n, x.device)), s_x[e], fmt_x)
            ys.append(dense.scaled_matmul(q_x, s_x[e], q_w[e].t(), s_w[e], x.dtype)[:n] if n
                      else x.new_zeros(0, weight.shape[1]))
            q_xs.append(q_x)
        ctx.save_for_backward(q_w, s_x, s_w, *q_xs)
        ctx.counts, ctx.states, ctx.dtypes = counts, states, (x.dtype, weight.dtype)
        return torch.cat(ys)

    @staticmethod
    def backward(ctx, dy):
        q_w, s_x, s_w, *q_xs = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        states, counts = ctx.states, ctx.counts
        a = reduce_amaxes(row_amaxes(dy, counts), states[0].grad.groups)
        s_g = torch.stack([st.grad.scale_for_amax(a[e]) for e, st in enumerate(states)])
        fmt_g = states[0].grad.fmt
        dxs = []
        dw = torch.zeros(q_w.shape, dtype=w_dtype, device=dy.device)
        for e, g in enumerate(dy.split(counts)):
            n = g.shape[0]
            if not n:
                dxs.append(g.new_zeros(0, q_w.shape[2], dtype=x_dtype))
                continue
            q_g = quantize(_pad_rows(g, q_xs[e].shape[0]), s_g[e], fmt_g)
            dxs.append(dense.scaled_matmul(q_g, s_g[e], q_w[e], s_w[e], x_dtype)[:n])
            dw[e] = dense.scaled_matmul(q_g.t(), s_g[e], q_xs[e], s_x[e], w_dtype)
        return torch.cat(dxs), dw, None, None


def grouped_fp8(x: torch.Tensor, weight: torch.Tensor, counts, states: list[ExpertState]) -> torch.Tensor:
    """The group's GEMMs x [m, in] -> [m, out] with weight [E, out, in], in FP8: x's rows sorted by
    expert, counts[e] of them expert e's, each expert's rows with that expert's scales."""
    counts = [int(n) for n in counts]
    if states[0].recipe.fine_grained:
        return _grouped_blocks(x, weight, counts, states)
    return _GroupedFP8.apply(x, weight, counts, states)


def _grouped_blocks(x, weight, counts, states) -> torch.Tensor:
    """The fine-grained group: each expert's rows through the dense layer's block-scaled
    GEMM (fp8_blocks.block_linear: its quantizers, tiles and float32 GEMM), exactly the
    reference's expert_linear, so every block of a cast is one device's. No scales are shared
    between experts (a block never spans two), so there is nothing to reduce or to stack."""
    return torch.cat([expert_linear(rows, w, None, st)
                      for rows, w, st in zip(x.split(counts), weight.unbind(0), states)])


@contextlib.contextmanager
def _dL_dW_now():
    """The experts' dL/dW is computed in their backward, as the 16-bit experts' F.linear's is
    (module docstring): a zero-bubble schedule's capture does not reach their GEMMs, whose
    weights are slices of one stacked parameter."""
    before, weight_grad.STORE.capturing = weight_grad.STORE.capturing, False
    try:
        yield
    finally:
        weight_grad.STORE.capturing = before


def expert_linear(x: torch.Tensor, weight: torch.Tensor, bias, state: ExpertState) -> torch.Tensor:
    """One expert alone, x [m, in]: the dense FP8 linear (FP8State.linear: fp8_linear, or the
    block-scaled block_linear) with its state, its rows padded as grouped_fp8 pads them on an FP8
    GPU (the reference's way, moe/reference.py). An expert without tokens runs on one zero row:
    its scalers see amax 0 in the forward and the backward, as grouped_fp8's do (the dense
    linear takes no empty input)."""
    m = x.shape[0]
    with _dL_dW_now():
        return state.linear(_pad_rows(x, max(1, _gemm_rows(m, x.device))), weight, bias)[:m]


__all__ = ["ExpertScaler", "ExpertState", "ExpertStates", "amaxes", "reduce_amaxes", "grouped_fp8",
           "expert_linear"]
