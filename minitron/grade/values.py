"""`show(label, value)`: what a check cell hands the grader: a value, never a verdict.

    from minitron.grade.values import show

    show("pairs sorted by expert", permute(experts, keep))
    show("bubble fraction", total, rtol=1e-9)

show prints `label: value` (rounded for reading) and, in a Jupyter kernel, publishes the value
beside that text as plain JSON data (MIME type `VALUE_MIME`). Nothing else of a check cell is
graded: `python -m minitron.grade` runs the reference's cells with the learner's answers in a
kernel, and a judging process that runs no learner code compares the values each check cell
shows, label by label and in order, with the ones the reference solution showed (stored in its
outputs), within the tolerance the REFERENCE gave. What a cell prints or warns is for reading.

Rules for check-cell authors:
  * Show what the learner's functions computed, not whether it is right: `show("counts",
    counts)`, never `print("right:", counts == [1, 1, 2, 1])`. A True computed in the kernel is
    one the learner's code can compute too; a value is right only if the learner's code made it.
  * Show the learner's own outputs directly, beside anything derived from them with the
    course's helpers (an answer can rebind or patch a helper the check calls, never make its
    own output right by doing so).
  * Every shown value counts: a check that shows fewer values than the reference (it stopped
    early), or any other labels, fails. Show the same labels whatever the answer does (show a
    value that says "refused" rather than skipping a show).
  * A value can be a bool, int, float (numpy and torch scalars, fractions.Fraction), str,
    None, a list or tuple or dict (str keys) of these, or a torch tensor / numpy array (sent as
    its shape and nested lists).

What counts as equal (minitron/grade/judge.py):
  * numbers of any type (bool, int, float, Fraction) are compared as numbers,
    |yours - reference| <= atol + rtol * |reference|: 0 equals 0.0, 2.0 equals 2, 9/2 equals
    4.5. NaN equals NaN, an infinity only itself;
  * strings exactly; lists, tuples and tensors element by element, of the same length (a
    tensor against a tensor also of the same shape); a tensor against a list by its elements;
  * dicts by the same keys, value by value.
The tolerance is the keyword arguments of the reference's show (default rtol 1e-5,
atol 1e-8): give exact integers and strings the default, and a float computed in another
order by a right answer the slack that order needs. `below=` makes a bound of it instead (any
number under the reference's bound passes). A large tensor is best shown as `projections(t)`
with atol = tolerance * its norm.

Values computed in forked ranks (minitron.launch) are shown by the notebook's process, from
what the ranks returned: a show in a rank only prints.
"""
from __future__ import annotations

import json
import math
import numbers
import os

VALUE_MIME = "application/vnd.minitron.value+json"
LONG = 16                  # a longer list is shown in part (and compared whole)
_KERNEL_PID = os.getpid()  # a forked rank imported this already: its pid differs


def encode(value):
    """The value as plain JSON data: numbers, strings, lists, dicts, None."""
    if value is None:
        return None
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):
        return str.__str__(value)
    if hasattr(value, "tolist") and hasattr(value, "shape"):      # torch tensor, numpy array or scalar
        data = value.tolist()
        if not isinstance(data, list):                              # a 0-d tensor, a numpy scalar
            return encode(data)
        return {"shape": [int(n) for n in value.shape], "data": encode(data)}
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        return {str(k): encode(v) for k, v in value.items()}
    raise TypeError(f"show: a {type(value).__name__} is not a value the grader can compare "
                    "(bool, int, float, str, None, list, tuple, dict, tensor or array)")


def readable(value) -> str:
    """The value as the learner reads it: floats to 6 significant digits, fractions as p/q."""
    from fractions import Fraction
    if isinstance(value, Fraction):
        return str(value)
    if hasattr(value, "tolist") and hasattr(value, "shape"):
        return readable(value.tolist())
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return str(value)
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        x = float(value)
        return str(x) if math.isinf(x) or math.isnan(x) else f"{x:.6g}"
    if isinstance(value, (list, tuple)):
        if len(value) > LONG:  # the grader compares every element; the line shows a few
            return ("[" + ", ".join(readable(v) for v in value[:4]) + ", ..., "
                    + ", ".join(readable(v) for v in value[-2:]) + f"] ({len(value)} elements)")
        return "[" + ", ".join(readable(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {readable(v)}" for k, v in value.items()) + "}"
    return str(value)


def projections(t, k: int = 8, seed: int = 0) -> list[float]:
    """A tensor seen through k fixed random directions (float64 dot products): k numbers that
    move with any element, to show for a large tensor. A right answer's differ from the
    reference's by about its error times the tensor's norm: give atol = tolerance * norm."""
    import torch
    flat = torch.as_tensor(t).detach().reshape(-1).to("cpu", torch.float64)
    directions = torch.randn(k, flat.numel(), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (directions @ flat).tolist()


def _kernel():
    """The IPython kernel's shell when this runs in the notebook's own process, else None."""
    if os.getpid() != _KERNEL_PID:
        return None
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    shell = get_ipython()
    return shell if shell is not None and getattr(shell, "kernel", None) is not None else None


def show(label: str, value, *, rtol: float = 1e-5, atol: float = 1e-8, below: float | None = None) -> None:
    """Print `label: value` and hand the value to the grader (see the module's docstring).
    `below`: not a value to reproduce but a bound: any number under the reference's `below`
    passes (the size of the largest tensor a right answer makes, say)."""
    if not isinstance(label, str) or not label:
        raise TypeError("show: the label must be a non-empty str")
    data = encode(value)
    line = f"{label}: {readable(value)}"
    shell = _kernel()
    if shell is None:
        print(line)
        return
    payload = {"label": label, "value": data, "rtol": float(rtol), "atol": float(atol)}
    if below is not None:
        payload["below"] = float(below)
    json.dumps(payload)  # fails here, in the check, if it is not plain data
    from IPython.display import display
    display({"text/plain": line, VALUE_MIME: payload}, raw=True)
