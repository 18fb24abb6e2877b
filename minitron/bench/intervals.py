"""Time spans on a measured timeline, as (start, end) pairs: how much of one lies inside others.
The overlap benches (tp_overlap.py, dualpipev_timeline.py) read a message's hidden time this way."""
from __future__ import annotations


def union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Overlapping spans merged, so that no instant is counted twice."""
    merged: list[list[float]] = []
    for s, e in sorted(spans):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def inside(s: float, e: float, spans) -> float:
    """How much of [s, e] lies inside `spans` (disjoint spans: pass them through union first)."""
    return sum(max(0.0, min(e, hi) - max(s, lo)) for lo, hi in spans)
