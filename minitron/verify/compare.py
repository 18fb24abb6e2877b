"""Comparison helpers shared by the tests, the verifier and the lessons."""
from __future__ import annotations

import torch


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|: one number, scale-free, worst element."""
    if actual.shape != expected.shape:
        raise ValueError(f"shape mismatch: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    scale = e.abs().max().item() if e.numel() else 0.0
    diff = (a - e).abs().max().item() if e.numel() else 0.0
    if scale == 0.0:
        return diff
    return diff / scale


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str = "tensor") -> float:
    """Raise AssertionError naming `what` when rel_err exceeds tol; return the error."""
    err = rel_err(actual, expected)
    if not err <= tol:  # also catches NaN
        raise AssertionError(f"{what}: relative error {err:.3e} exceeds {tol:.1e}")
    return err
