"""The verdict on one check cell: the values it showed against the reference's, as plain data.

Runs in the grading process, which runs no learner code: what arrives from the kernel is JSON
(numbers, strings, lists, dicts, None) already parsed, and every tolerance is the reference's.
The rules are minitron/grade/values.py's docstring.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from minitron.grade.values import readable


@dataclass(frozen=True)
class Shown:
    """One value a check cell showed: as the reference gave it, or as the learner's run did."""
    label: str
    value: object          # plain JSON data
    rtol: float = 1e-5
    atol: float = 1e-8
    below: float | None = None   # the reference's: a bound, not a value to reproduce

    @classmethod
    def from_data(cls, data) -> "Shown":
        """From a message's payload; anything but the expected plain fields raises ValueError."""
        if not isinstance(data, dict) or not isinstance(data.get("label"), str) or "value" not in data:
            raise ValueError("not a shown value")
        rtol, atol = data.get("rtol", 1e-5), data.get("atol", 1e-8)
        if not all(type(t) in (int, float) and t >= 0 for t in (rtol, atol)):
            raise ValueError("a tolerance is not a number")
        below = data.get("below")
        if below is not None and type(below) not in (int, float):
            raise ValueError("a bound is not a number")
        return cls(data["label"], _plain(data["value"]), float(rtol), float(atol),
                   None if below is None else float(below))


def _plain(x):
    """x if it is plain JSON data (what json.loads makes), else ValueError."""
    if x is None or type(x) in (bool, int, float, str):
        return x
    if type(x) is list:
        return [_plain(v) for v in x]
    if type(x) is dict and all(type(k) is str for k in x):
        return {k: _plain(v) for k, v in x.items()}
    raise ValueError(f"not plain data: {type(x).__name__}")


def _is_tensor(x) -> bool:
    return type(x) is dict and set(x) == {"shape", "data"}


def _number(x) -> bool:
    return type(x) in (bool, int, float)


def difference(mine, ref, rtol: float, atol: float, where: str = "") -> str | None:
    """None when `mine` equals `ref` within the tolerance, else where and how they differ."""
    if _is_tensor(ref) or _is_tensor(mine):
        if _is_tensor(ref) and _is_tensor(mine) and mine["shape"] != ref["shape"]:
            return f"{where or 'the value'} has shape {mine['shape']}, the reference {ref['shape']}"
        return difference(mine["data"] if _is_tensor(mine) else mine,
                          ref["data"] if _is_tensor(ref) else ref, rtol, atol, where)
    if _number(ref) and _number(mine):
        a, b = float(mine), float(ref)
        if a == b or (math.isnan(a) and math.isnan(b)):
            return None
        if math.isfinite(a) and math.isfinite(b) and abs(a - b) <= atol + rtol * abs(b):
            return None
        return f"{where or 'the value'} is {readable(mine)}, the reference {readable(ref)}"
    if type(ref) is list and type(mine) is list:
        if len(mine) != len(ref):
            return f"{where or 'the value'} has {len(mine)} elements, the reference {len(ref)}"
        for k, (x, y) in enumerate(zip(mine, ref)):
            found = difference(x, y, rtol, atol, f"{where}[{k}]" if where else f"element [{k}]")
            if found:
                return found
        return None
    if type(ref) is dict and type(mine) is dict:
        if set(mine) != set(ref):
            return f"{where or 'the value'} has keys {sorted(mine)}, the reference {sorted(ref)}"
        for k in ref:
            found = difference(mine[k], ref[k], rtol, atol, f"{where}[{k!r}]")
            if found:
                return found
        return None
    if type(ref) is type(mine) and mine == ref:   # str, None
        return None
    return f"{where or 'the value'} is {_brief(mine)}, the reference {_brief(ref)}"


def _brief(x) -> str:
    text = readable(x["data"] if _is_tensor(x) else x)
    return repr(text) if isinstance(x, str) else (text if len(text) <= 60 else text[:57] + "...")


def compare(mine: list[Shown], reference: list[Shown]) -> str | None:
    """None when the learner's run showed the reference's values, else the first difference."""
    for k, ref in enumerate(reference):
        if k >= len(mine):
            missing = ", ".join(repr(r.label) for r in reference[k:k + 3])
            return (f"it showed {len(mine)} of its {len(reference)} values (it stopped before "
                    f"showing {missing}{', ...' if len(reference) - k > 3 else ''})")
        got = mine[k]
        if got.label != ref.label:
            return f"its value {k + 1} is labelled {got.label!r}, the reference's {ref.label!r}"
        if ref.below is not None:
            if not (_number(got.value) and float(got.value) < ref.below):
                return f"{ref.label}: yours is {_brief(got.value)}, not below {readable(ref.below)}"
            continue
        found = difference(got.value, ref.value, ref.rtol, ref.atol)
        if found:
            return f"{ref.label}: {found.replace('the value', 'yours', 1)}"
    if len(mine) > len(reference):
        return f"it showed {len(mine)} values, the reference {len(reference)} (first extra: {mine[len(reference)].label!r})"
    return None
