"""Activation memory of one Transformer layer on one rank, term by term.

What autograd keeps for the backward pass of one GPT layer (pre-norm, LayerNorm, GeLU MLP
of width 4h, dropout after attention probabilities and on both residual branches), with
b = micro-batch, s = sequence, h = hidden, a = heads, t = tensor-parallel size.
Korthikanti et al. (2022), "Reducing Activation Recomputation in Large Transformer Models",
count it with 16-bit activations and 1-byte dropout masks; in their units (bytes):

    attention   QKV input 2sbh, Q and K 4sbh, V 2sbh, softmax output 2as^2b,
                its dropout mask as^2b, dropped probabilities 2as^2b,
                out-projection input 2sbh, residual dropout mask sbh   = 11sbh + 5as^2b
    MLP         fc1 input 2sbh, GeLU input 8sbh, fc2 input 8sbh,
                residual dropout mask sbh                               = 19sbh
    LayerNorms  two inputs                                              =  4sbh
    total                                                               = 34sbh + 5as^2b

Which terms tensor (TP) and sequence (SP) parallelism divide by t:
    split by heads or columns under TP (always /t): Q, K, V, the scores, the out-projection
        input, the MLP hidden layer: 24sbh/t + 5as^2b/t;
    the norm/dropout region (replicated under TP, /t under SP): norm inputs, residual masks;
    the inputs of the QKV and fc1 matmuls: replicated under TP; under SP they are the
        all-gathered sequence, kept whole by minitron (ColumnParallelLinear saves what it
        multiplied), /t only with Megatron's re-gather (keep the shard, all-gather it again
        in backward).
Today's shapes (keyword arguments; the defaults are the paper's GPT): grouped-query attention
with kv_heads < a keeps K and V of kv_heads/a the size (Q, K, V = 2sbh (1 + 2 kv/a)); an MLP
of width f keeps 4sbf (GeLU in and out, 16sbh at f = 4h), SwiGLU 6sbf (the gate and up
projections, and their product); flash attention (Dao et al.) keeps no s x s matrix, only the
softmax's log-sum-exp, 4 bytes per query and head (4asb), whatever the recomputation.
Recomputation: "selective" recomputes the core attention, so its scores are not stored;
"full" stores only each layer's input (2sbh, /t under SP) and recomputes the rest.

`PAPER` reproduces the paper's Table 2; `MINITRON` is what minitron's float32 model saves
(masks are float32 too, plus the two small buffers the paper ignores: each LayerNorm's mean
and 1/std per token, and attention's boolean [s, s] causal mask), as lesson 03 measures.
A fuller estimator (parameters, optimizer state, pipelines) is a later lesson's job.
"""
from __future__ import annotations

import dataclasses

from ..config import CHOICES

RECOMPUTE = CHOICES["recompute"]       # ModelConfig's own choices (none, selective, full)


@dataclasses.dataclass(frozen=True)
class Precision:
    """Bytes per stored element, and whether the small buffers the paper ignores count."""
    name: str
    activation: int
    mask: int
    small_buffers: bool


PAPER = Precision("paper: 16-bit activations, 1-byte masks", activation=2, mask=1, small_buffers=False)
MINITRON = Precision("minitron: float32 activations and masks", activation=4, mask=4, small_buffers=True)


def _check(b: int, s: int, h: int, a: int, t: int, sp: bool, regather: bool, recompute: str) -> None:
    for name, value in (("b", b), ("s", s), ("h", h), ("a", a), ("t", t)):
        if type(value) is not int or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if h % a:
        raise ValueError(f"hidden h={h} is not divisible by the number of heads a={a}")
    if a % t:
        raise ValueError(f"tensor parallelism splits the a={a} heads across t={t} ranks: "
                         f"choose t dividing {a}")
    if sp and s % t:
        raise ValueError(f"sequence parallelism splits the s={s} tokens across t={t} ranks: "
                         f"choose s a multiple of {t}")
    if regather and not sp:
        raise ValueError("regather (Megatron's all-gather again in backward) exists only "
                         "under sequence parallelism: pass sp=True or regather=False")
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r}: choose one of {RECOMPUTE}")


def layer_terms(b: int, s: int, h: int, a: int, t: int = 1, *, sp: bool = False,
                regather: bool = False, recompute: str = "none",
                precision: Precision = PAPER, kv_heads: int | None = None, ffn: int | None = None,
                swiglu: bool = False, flash: bool = False) -> dict[str, int]:
    """Bytes one layer saves for backward on one rank, by term (in the order of the layer).

    t=1 is one device. Terms that are zero in this configuration are left out.
    """
    _check(b, s, h, a, t, sp, regather, recompute)
    act, mask = precision.activation, precision.mask
    bsh = b * s * h
    region = t if sp else 1                  # the norm/dropout region: /t under SP
    gathered = t if regather else 1          # QKV and fc1 inputs: /t only when re-gathered

    if recompute == "full":                  # only the layer's input survives the forward
        return {"layer input": act * bsh // region}

    kv, f = kv_heads or a, ffn or 4 * h
    terms = {
        "norm inputs": 2 * act * bsh // region,
        "QKV and fc1 inputs": 2 * act * bsh // gathered,
        "Q, K, V": act * bsh * (a + 2 * kv) // (a * t),
        "attention scores": (2 * act + mask) * a * s * s * b // t,
        "attention output": act * bsh // t,
        "MLP hidden (GeLU in, out)": (3 if swiglu else 2) * act * b * s * f // t,
        "residual dropout masks": 2 * mask * bsh // region,
    }
    if flash:                                # no s x s matrix: the log-sum-exp per query and head
        del terms["attention scores"]
        terms["softmax log-sum-exp"] = 4 * a * s * b // t
    if precision.small_buffers:
        terms["norm mean, 1/std"] = 2 * 2 * 4 * b * s // region   # float32, 2 per token, 2 norms
        terms["causal mask"] = s * s                               # bool [s, s], 1 byte each
    if flash:
        terms.pop("causal mask", None)       # the kernel masks by index
    if recompute == "selective":             # the core attention is recomputed in backward
        terms.pop("attention scores", None)
        terms.pop("causal mask", None)
    return terms


def layer_bytes(b: int, s: int, h: int, a: int, t: int = 1, **options) -> int:
    """The sum of layer_terms: activation bytes one layer keeps on one rank."""
    return sum(layer_terms(b, s, h, a, t, **options).values())
