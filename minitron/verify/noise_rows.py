"""Rows for a low-precision run (bfloat16, float16, fp8): each tensor's error held against the
rounding noise of the same precision, measured in the reference's twins (verify/noise.py),
norm-wise and along the reference.

The constants were chosen by measurement: tools/verdict_margins.py runs correct splits and
every plant over seeds 0-3 (tp2+SP, vocab 64, seq 8, hidden 32, 2 layers, 4 heads, dropout
0.1, 2 steps) in bfloat16, float16 and FP8 under each recipe, and prints each run's margin.
Every statistic below is a ratio z = error / its noise unit; a row's tolerance is C x unit."""
from __future__ import annotations

import collections
import dataclasses

import torch

from .float32_rows import _same_shape, pattern
from .report import Row, _ratio

C_NORM = 6
"""Norm-wise: a correct split's ||e|| is at most 1.8x the twins' RMS ||n_k|| (z <= 1.77 over 24
correct runs of tools/verdict_margins.py and the matrix's 12 low-precision rows; fp8 delayed the
highest: a split differs from one device in more reductions than a twin's one 2-way cut), so 6
passes it by 3.4x. Plants of FP8 scaling reach z = 4-38 norm-wise, but their scale rows catch
them first, and a 16-bit gradient error is caught along; below 6 the margins of correct fp8 and
bfloat16 runs fall under 3 (C_NORM = 4: 2.3x)."""
C_ALONG = 15
"""Along the reference: a correct split's component along r reaches 3.85 units (the matrix's
dp2 x cp2 and pp2 x cp2 bfloat16 rows, v.weight; 3.03 in the 24 runs at the small shape), so
15 passes it by 3.9x; the plant grad (3.9% in bfloat16, 1% in float16, plants.grad_error) is
z >= 60 in bfloat16, failing by >= 4.0x; float16's 1% fails by >= 7x."""
C_SCALE = 5
"""FP8 scale rows (fp8_rows.scale_row; fine-grained recipes: the largest and the smallest block
scale, each judged apart): a correct split's largest scale offset is 1.2x its twins' (or 1/16,
log2), so 5 passes it by 4.2x; the scale plants move scales by 26x that or
more (tiles along the wrong dimension under blockwise, the least), failing by >= 5x."""
NOISY = 0.25
"""A reference whose twins differ from it by this much (norm-wise) is mostly rounding noise
itself (the key bias's gradient, zero in exact arithmetic): no direction to be along."""


@dataclasses.dataclass
class NoiseStats:
    """One tensor's error e = actual - reference and the twins' n_k = twin_k - reference
    (verify/noise.py), against r = the reference:

        norm       ||e|| / ||r||            floor   RMS over k of ||n_k|| / ||r||
        along      <e, r> / <r, r>          noise   RMS over k of <n_k, r> / <r, r>
        n_eff      (sum r^2)^2 / sum r^4    how many entries carry r (numel where all are alike)

    `along` is the error's component along the reference: a scale error (a gradient 1% off:
    along = 0.01) is all along it, rounding noise mostly across (measured in the twins)."""
    norm: float
    floor: float
    along: float
    along_noise: float
    numel: int
    n_eff: float = 1.0


def noise_stats(actual: torch.Tensor, expected: torch.Tensor, twins) -> NoiseStats:
    _same_shape("tensor", actual, expected)
    a, r = (x.detach().double().reshape(-1) for x in (actual, expected))
    ns = [t.detach().double().reshape(-1) - r for t in twins]
    e, rr = a - r, float(r @ r)
    rms = lambda xs: (sum(x * x for x in xs) / len(xs)) ** 0.5
    if rr == 0.0:
        return NoiseStats(float(e.norm()), rms([float(n.norm()) for n in ns]), 0.0, 0.0, r.numel())
    norm_r = rr ** 0.5
    return NoiseStats(float(e.norm()) / norm_r, rms([float(n.norm()) / norm_r for n in ns]),
                      float(e @ r) / rr, rms([float(n @ r) / rr for n in ns]), r.numel(),
                      rr * rr / float((r * r) @ (r * r)))


def along_unit(s: NoiseStats, floor: float, pooled_noise: float) -> float:
    """The noise unit of the along row: the twins' spread of `along`, pooled (RMS) over the
    tensors of one name pattern (the layers of a family: 6 twins per layer are few to estimate a
    spread from), and at least floor / sqrt(n_eff): rounding noise of norm-wise size `floor`,
    relative entry by entry with independent signs, has that RMS along r (its projection
    sum_i d_i r_i^2 / sum_i r_i^2, d_i ~ floor). Measured against the twins' spread of each
    tensor alone, with floor / sqrt(numel) below it, correct splits reached z = 3.9 at the small
    shape; with this unit 3.0 (the plants' z unchanged), as one tensor's 6 twins may happen to
    agree along r. The second bound is what rounding gives when the twins' errors share no
    direction; the first, the correlated part (a rounded loss scales every gradient alike)."""
    return max(pooled_noise, floor / s.n_eff ** 0.5)


def noise_rows(step: int, kind: str, tensors: dict[str, tuple], floor_min: float = 0.0,
               along: bool = True) -> list[Row]:
    """Rows for a low-precision run: per name pattern the worst tensor (by err/tol) of

        norm-wise    ||e|| / ||r||     <=  C_NORM  * max(floor, floor_min)
        along        |<e, r>| / <r, r>  <=  C_ALONG * along_unit

    `tensors`: name -> (actual, reference, [twins]). floor_min: the least floor (the loss: the
    logits', as a scalar's twins may land on the reference by chance). The along row is left
    out where the reference is mostly noise (floor > NOISY) and for scalars."""
    stats = {name: noise_stats(a, r, twins) for name, (a, r, twins) in tensors.items()}
    judged = {name for name, s in stats.items()
              if along and s.numel > 1 and max(s.floor, floor_min) <= NOISY}
    spread = collections.defaultdict(list)       # the twins' along spreads of each pattern's tensors
    for name in judged:
        spread[pattern(name)].append(stats[name].along_noise ** 2)
    worst: dict[str, Row] = {}

    def keep(row: Row) -> None:
        prev = worst.get(row.quantity)
        if prev is None or _ratio(row) > _ratio(prev):
            worst[row.quantity] = row
    for name, s in stats.items():
        floor = max(s.floor, floor_min)
        keep(Row(step, f"{kind} {pattern(name)}".strip(), s.norm, C_NORM * floor))
        if name in judged:
            family = spread[pattern(name)]
            unit = along_unit(s, floor, (sum(family) / len(family)) ** 0.5)
            keep(Row(step, f"{kind} {pattern(name)} along".strip(), abs(s.along), C_ALONG * unit))
    return list(worst.values())
