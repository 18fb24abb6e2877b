"""Rows for a low-precision run (bfloat16, float16, fp8): each tensor's error held against the
rounding noise of the same precision, measured in the reference's twins (verify/noise.py),
norm-wise and along the reference."""
from __future__ import annotations

import dataclasses

import torch

from .float32_rows import _same_shape, pattern
from .report import Row, _ratio

C_NORM = 4       # norm-wise error at most C_NORM x the twins' (measured: see noise_rows)
C_ALONG = 12     # the component along the reference at most C_ALONG x the twins' spread of it
NOISY = 0.25     # a reference whose twins differ from it by this much (norm-wise) is mostly
                 # rounding noise itself (the key bias's gradient): no direction to be along


@dataclasses.dataclass
class NoiseStats:
    """One tensor's error e = actual - reference and the twins' n_k = twin_k - reference
    (verify/noise.py), against r = the reference:

        norm       ||e|| / ||r||            floor   RMS over k of ||n_k|| / ||r||
        along      <e, r> / <r, r>          noise   RMS over k of <n_k, r> / <r, r>

    `along` is the error's component along the reference: a scale error (a gradient 1% off:
    along = 0.01) is all along it, rounding noise mostly across (measured in the twins)."""
    norm: float
    floor: float
    along: float
    along_noise: float
    numel: int


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
                      float(e @ r) / rr, rms([float(n @ r) / rr for n in ns]), r.numel())


def noise_rows(step: int, kind: str, tensors: dict[str, tuple], floor_min: float = 0.0,
               along: bool = True) -> list[Row]:
    """Rows for a low-precision run: per name pattern the worst tensor (by err/tol) of

        norm-wise    ||e|| / ||r||     <=  C_NORM  * max(floor, floor_min)
        along        |<e, r>| / <r, r>  <=  C_ALONG * max(along_noise, floor / sqrt(numel))

    `tensors`: name -> (actual, reference, [twins]). floor_min: the least floor (the loss: the
    logits', as a scalar's twins may land on the reference by chance). The along row is left
    out where the reference is mostly noise (floor > NOISY) and for scalars."""
    worst: dict[str, Row] = {}

    def keep(row: Row) -> None:
        prev = worst.get(row.quantity)
        if prev is None or _ratio(row) > _ratio(prev):
            worst[row.quantity] = row
    for name, (a, r, twins) in tensors.items():
        s = noise_stats(a, r, twins)
        floor = max(s.floor, floor_min)
        keep(Row(step, f"{kind} {pattern(name)}".strip(), s.norm, C_NORM * floor))
        if along and s.numel > 1 and floor <= NOISY:
            noise = max(s.along_noise, floor / s.numel ** 0.5)
            keep(Row(step, f"{kind} {pattern(name)} along".strip(), abs(s.along), C_ALONG * noise))
    return list(worst.values())
