"""Rows held to the float32 bars (tolerances.py): gradients and whole tensors (logits, loss,
dL/dX) by relative error, each tensor's optimizer update at the update's own scale. Rows are
grouped by name pattern, the layer index replaced by `*` (the worst over the layers)."""
from __future__ import annotations

import math
import re

import torch

from .compare import rel_err
from .report import Row
from .tolerances import FLOOR, ULP_SLACK, update_tolerance


def pattern(name: str) -> str:
    return re.sub(r"layers\.\d+\.", "layers.*.", name)


def _worst_per_pattern(step: int, kind: str, errs: dict[str, float], tol: float) -> list[Row]:
    worst: dict[str, float] = {}
    for name, e in errs.items():
        prev = worst.get(pattern(name), 0.0)
        worst[pattern(name)] = prev if prev != prev or e <= prev else e   # NaN sticks
    return [Row(step, f"{kind} {p}", e, tol) for p, e in worst.items()]


def _same_names(kind: str, actual: dict, expected: dict) -> None:
    if actual.keys() != expected.keys():
        raise AssertionError(f"{kind}: parameter names differ: {sorted(actual.keys() ^ expected.keys())}")


def grad_rows(step: int, actual: dict, expected: dict, tol: float) -> list[Row]:
    """One row per name pattern: the worst error over the layers it covers.

    Each tensor's error is relative to its own largest entry, but never to less than FLOOR
    times the largest gradient entry in the whole model: a gradient that is zero up to
    rounding (the key bias's: softmax ignores a constant added to all scores of a query) has
    no scale of its own to be relative to.
    """
    _same_names("grad", actual, expected)
    floor = FLOOR * max(e.abs().max().item() for e in expected.values())
    errs = {}
    for name, e in expected.items():
        _same_shape(name, actual[name], e)   # a broadcast would compare the wrong entries
        diff = (actual[name].double() - e.double()).abs().max().item()
        errs[name] = diff / max(e.abs().max().item(), floor)
    return _worst_per_pattern(step, "grad", errs, tol)


def _same_shape(name: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    if actual.shape != expected.shape:
        raise ValueError(f"{name}: the parallel side's shape {tuple(actual.shape)} is not the "
                         f"reference's {tuple(expected.shape)} (a gather or shard rule is wrong)")


def ulp(t: torch.Tensor) -> torch.Tensor:
    """The spacing of t's dtype at each |entry| (as float64)."""
    a = t.detach().abs()
    return (torch.nextafter(a, torch.full_like(a, math.inf)) - a).double()


def update_err(new: torch.Tensor, old: torch.Tensor, ref_new: torch.Tensor, ref_old: torch.Tensor) -> float:
    """max |u - u_ref| beyond ULP_SLACK spacings of the weight, over max |u_ref|."""
    _same_shape("weight", new, ref_new)
    u = new.double() - old.double()          # exact: float32 differences fit in float64
    u_ref = ref_new.double() - ref_old.double()
    spacing = ulp(ref_new)
    if new.dtype != ref_new.dtype:
        # fp8: bf16 weights here, float32 in the reference, so both the old and the new weight
        # were rounded on this side only: allow the spacing of either, in this side's dtype
        spacing = torch.maximum(ulp(ref_new.to(new.dtype)), ulp(ref_old.to(new.dtype)))
    excess = ((u - u_ref).abs() - ULP_SLACK * spacing).clamp(min=0).max().item()
    scale = u_ref.abs().max().item()
    return excess / scale if scale > 0 else excess


def update_rows(step: int, new: dict, old: dict, ref_new: dict, ref_old: dict,
                kind: str = "weight") -> list[Row]:
    """kind "weight": the model's weights; "master": a 16-bit run's fp32 master weights."""
    _same_names(kind, new, ref_new)
    errs = {n: update_err(new[n], old[n], ref_new[n], ref_old[n]) for n in ref_new}
    return _worst_per_pattern(step, kind, errs, update_tolerance())


def sum_rows(step: int, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], tol: float) -> list[Row]:
    """Rows for whole tensors (logits, loss, dL/dX): rel_err against the reference."""
    return [Row(step, what, rel_err(a, e), tol) for what, (a, e) in pairs.items()]
