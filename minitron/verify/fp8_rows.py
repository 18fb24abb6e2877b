"""The FP8 scale rows of a verification (--dtype fp8): every scaler's latest scale against one
device's (per-tensor recipes: the scale itself; blockwise and mxfp8: the largest block scale and
the smallest, tensor_parallel/fp8_blocks.BlockScaler.last and .smallest; not an expert's
token-blocked largest, _judged), and under mxfp8 that each scale is a power of two."""
from __future__ import annotations

import torch

from ..runtime import comm
from ..tensor_parallel.fp8_batched import ExpertState
from ..tensor_parallel.fp8_linear import SCALERS, named_fp8_states
from .checks import C_SCALE, Row


def _scale_names(ref) -> list[tuple[str, int]]:
    return [(name, k) for name in named_fp8_states(ref) for k in range(len(SCALERS))]


def _fine_grained(ref) -> bool:
    return next(iter(named_fp8_states(ref).values())).recipe.fine_grained


def gathered_scales(model, ref, grid) -> torch.Tensor:
    """The latest scale of every FP8 scaler of the split model, in the reference's order, on
    every rank; for a fine-grained recipe each scaler's largest block scale, then (a second
    half) its smallest. All-reduces (collective) over pp and ep (a layer of another stage, or
    an expert of another ep rank, gives 0) and, fine-grained, over the amax group: each rank's
    largest block scale is its own blocks' (fp8_blocks.BlockScaler), and the largest of the
    group's is the whole tensor's, one device's; the smallest goes as its reciprocal, amax / max,
    whose max over the ranks (0 where absent) is the whole tensor's amax's (inf: no amax)."""
    mine, names, fine = named_fp8_states(model), _scale_names(ref), _fine_grained(ref)
    largest = torch.zeros(len(names), dtype=torch.float64, device=grid.device)
    inverse_smallest = torch.zeros_like(largest)
    # a replica's (dp, cp, ep) gradients are of its own mean loss: dense_dp times the whole
    # batch's, so its gradient scales are 1/dense_dp of one device's (the casts are the same)
    replicas = grid.dense_dp.size
    for i, (name, k) in enumerate(names):
        scaler = mine[name].scalers()[k] if name in mine else None
        if scaler is not None and scaler.last is not None:
            to_one_device = replicas if SCALERS[k] == "grad" else 1
            largest[i] = scaler.last * to_one_device
            if fine and scaler.smallest is not None:
                inverse_smallest[i] = 1 / (scaler.smallest.double() * to_one_device)
    out = torch.cat([largest, inverse_smallest]) if fine else largest
    if fine:
        comm.all_reduce(out, grid.groups["amax"], op="max")
    out = comm.all_reduce(comm.all_reduce(out, grid.pp, op="max"), grid.ep, op="max")
    return torch.cat([out[:len(names)], 1 / out[len(names):]]) if fine else out


SCALE_FLOOR = 1 / 16   # log2: an amax one device and a split see a few bf16 roundings apart


def amax_binades(scales: torch.Tensor, reference: torch.Tensor, pow2) -> torch.Tensor:
    """How far apart, in log2, the amaxes behind two scales at least are: |log2(scale ratio)|,
    and for power-of-two scales (mxfp8's E8M0; `pow2` a bool, or one per scale) one binade less,
    clipped at 0. A power-of-two scale keeps only its amax's binade, floor(log2 amax): an amax a
    rounding below 2^e and one a rounding above it give scales one binade apart (seen in the
    twins, and in correct splits: at most 1 scaler of 24 a step, tp2+SP, hidden 32, seeds 0-3),
    so one binade carries no information; k binades apart means the amaxes are at least 2^(k-1)
    apart. Without the clip a twin's one-binade flip made the bar 4 binades (C_NORM x 1), and tiles
    along the wrong dimension (plant fp8-block-wrong-dim: 3 binades off at seed 2) passed."""
    off = (scales.double() / reference.double()).log2().abs()
    return torch.where(torch.as_tensor(pow2, device=off.device), (off - 1).clamp(min=0), off)


def _pow2(ref) -> torch.Tensor:
    """Per scale (gathered_scales' order): is it an E8M0 one (mxfp8), judged by amax_binades' clip."""
    states = named_fp8_states(ref)
    mx = [states[n].recipe.scaling == "mxfp8" for n, _ in _scale_names(ref)]
    return torch.tensor(mx + mx if _fine_grained(ref) else mx)


def _judged(ref) -> torch.Tensor:
    """Per scale: is it one device's to compare. Not an expert's largest block scale of its input
    or output gradient (fine-grained): those casts' last are dW's operands, blocked down the
    tokens (fp8_blocks.tiles' x_tokens, g_tokens), and which tokens share a block is the order
    the dispatcher delivers them in: by source rank (moe/dispatch.py), under tp x SP each tp
    rank's chunk of every sequence, and with dp each replica's tokens cast apart. Then the
    blocks hold other tokens than one device's: another cast, not the same cast's scale (at the
    test's shape, ep2 x tp2+SP, mxfp8, seeds 0-3: 2-3 binades off where the twins move that
    scale by 0). Where the order is one device's (ep alone) the twins' own routing moves it by
    up to 7 binades, a bar of 35: no test either way. What is kept: the same casts' smallest
    block scale (the tensor's amax, whatever the order), the expert's weight (its blocks are its
    own rows), and dW itself against the twins' noise (noise_rows)."""
    states = named_fp8_states(ref)
    names = _scale_names(ref)
    if not _fine_grained(ref):
        return torch.ones(len(names), dtype=torch.bool)
    tokens = [isinstance(states[n], ExpertState) and SCALERS[k] != "weight" for n, k in names]
    return torch.tensor([not t for t in tokens] + [True] * len(names))


def _ref_scales(model, ref) -> torch.Tensor:
    """gathered_scales' tensor of an unsplit model (the reference or a twin), float64."""
    states, names = named_fp8_states(model), _scale_names(ref)
    scalers = [states[n].scalers()[k] for n, k in names]
    def value(scaler, kind):
        s = getattr(scaler, kind)
        return torch.tensor(float("inf")) if s is None else s.double().reshape(()).cpu()
    kinds = ["last", "smallest"] if _fine_grained(ref) else ["last"]
    return torch.stack([value(sc, kind) for kind in kinds for sc in scalers])


def _binades(a: torch.Tensor, r: torch.Tensor, clipped, twin: bool) -> torch.Tensor:
    """amax_binades(a, r), where an inf (a smallest block scale of a cast without an amax: an
    expert without tokens) is 0 beside an inf, and beside a number inf for a split (which routes
    as one device) but 0 for a twin (whose routing may leave an expert without tokens)."""
    off = amax_binades(a, r, clipped)
    empty_a, empty_r = torch.isinf(a), torch.isinf(r)
    one_sided = torch.full_like(off, 0.0 if twin else float("inf"))
    return torch.where(empty_a & empty_r, torch.zeros_like(off),
                       torch.where(empty_a ^ empty_r, one_sided, off))


def scale_row(step: int, scales: torch.Tensor, ref, twins) -> Row:
    """With the amaxes reduced over tp x cp x ep x dp every cast must use the scale one device uses:
    the largest amax_binades(scale, the reference's) over every scaler, against C_SCALE times the
    twins' (at least SCALE_FLOOR: 4%, a few roundings of a bf16 amax). Fine-grained: the largest
    block scales and the smallest are judged apart, each against its own twins' offsets (the
    largest, a block of small entries, moves by binades in the twins; the smallest, the tensor's
    amax, by roundings), and the row is the one nearer failing."""
    r = _ref_scales(ref, ref).to(scales.device)
    pow2, judged = _pow2(ref).to(r.device), _judged(ref).to(r.device)
    unjudged = lambda off: torch.where(judged, off, torch.zeros_like(off))
    off = unjudged(_binades(scales, r, pow2, twin=False))
    twin_off = [unjudged(_binades(_ref_scales(t, ref).to(r.device), r, pow2, twin=True)) for t in twins]
    names, n = _scale_names(ref), len(_scale_names(ref))
    halves = [("", slice(0, n))] + ([("smallest block ", slice(n, 2 * n))] if len(r) > n else [])
    rows = []
    for label, part in halves:
        floor = max([float(t[part].max()) for t in twin_off] + [SCALE_FLOOR])
        err, worst = float(off[part].max()), part.start + int(off[part].argmax())
        name, k = names[worst % n]
        detail = "" if err <= C_SCALE * floor else (
            f"{name} {SCALERS[k]} {label}scale {float(scales[worst]):.4g}, one device's {float(r[worst]):.4g}")
        rows.append(Row(step, "fp8 scales (log2)", err, C_SCALE * floor, detail))
    return max(rows, key=lambda row: (not row.ok, row.err / row.tol))   # a NaN fails


def pow2_row(step: int, scales: torch.Tensor, ref) -> Row:
    """mxfp8: every scale an E8M0 number, a power of two: |log2 s - round(log2 s)| = 0, bitwise."""
    e = scales.double().log2()
    frac = torch.where(torch.isinf(scales), 0.0, (e - e.round()).abs())   # inf: no amax, no scale
    err, worst = float(frac.max()), int(frac.argmax())
    name, k = _scale_names(ref)[worst % len(_scale_names(ref))]
    detail = "" if err == 0 else f"{name} {SCALERS[k]} scale {float(scales[worst]):.6g}, not a power of 2"
    return Row(step, "fp8 mx scales (powers of 2)", err, 0.0, detail)
