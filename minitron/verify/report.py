"""What one verification found: a Row per (step, quantity) with its error and tolerance, and
the Report that prints them as a table and a PASS/FAIL verdict."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Row:
    step: int
    quantity: str
    err: float
    tol: float
    detail: str = ""      # what went wrong, where a number alone does not say (replicas)

    @property
    def ok(self) -> bool:
        return self.err <= self.tol   # False for NaN too


@dataclasses.dataclass
class Report:
    rows: list[Row]

    @property
    def passed(self) -> bool:
        return all(r.ok for r in self.rows)

    @property
    def max_rel_err(self) -> float:
        return max(r.err for r in self.rows)

    @property
    def failures(self) -> list[Row]:
        return [r for r in self.rows if not r.ok]

    def worst(self, rows: list[Row]) -> Row:
        """The row nearest to (or furthest past) its tolerance."""
        return max(rows, key=_ratio)

    def table(self) -> str:
        width = max(len(r.quantity) for r in self.rows)
        lines = [f"{'step':>4}  {'quantity':<{width}}  {'rel_err':>9}  {'tol':>8}  {'margin':>7}  ok"]
        for r in self.rows:
            tol = f"{r.tol:8.1e}" if r.tol else f"{'bitwise':>8}"
            margin = f"{r.tol / r.err:6.0f}x" if r.tol and r.err > 0 else f"{'-':>7}"
            lines.append(f"{r.step:>4}  {r.quantity:<{width}}  {r.err:9.2e}  {tol}  {margin}  "
                         f"{'yes' if r.ok else 'NO'}")
        if self.passed:
            w = self.worst([r for r in self.rows if r.tol] or self.rows)
            lines.append(f"smallest margin: tol/err = {w.tol / w.err if w.err else float('inf'):.0f}x "
                         f"(step {w.step} {w.quantity}: {w.err:.2e} vs tol {w.tol:.1e})")
        return "\n".join(lines)

    def verdict(self) -> str:
        if self.passed:
            return f"PASS max_rel_err={self.max_rel_err:.2e}"
        w = self.worst(self.failures)
        where = w.detail or f"rel_err={w.err:.2e} > tol={w.tol:.1e}"
        return (f"FAIL {len(self.failures)} of {len(self.rows)} comparisons; worst: step "
                f"{w.step} {w.quantity}: {where}")

    def summary(self, margin: float = 3.0) -> str:
        """The verdict in words that hold on any CPU, for the lessons' 16-bit runs (whose errors'
        digits move with the CPU's summation order): a pass, and whether every error is at most
        1/margin of its tolerance; or a fail, its worst quantity and how many times its tolerance
        that error is, to one significant figure."""
        if self.passed:
            w = self.worst([r for r in self.rows if r.tol] or self.rows)
            return f"PASS, every error at most 1/{margin:g} of its tolerance: {_ratio(w) <= 1 / margin}"
        w = self.worst(self.failures)
        times = "inf" if _ratio(w) == float("inf") else f"{float(f'{_ratio(w):.1g}'):g}"
        return f"FAIL, worst: step {w.step} {w.quantity}, {times}x its tolerance"


def _ratio(r: Row) -> float:
    """err / tol; inf for NaN and for any difference where none is allowed."""
    if r.err != r.err:
        return float("inf")
    if r.tol == 0:
        return float("inf") if r.err > 0 else 0.0
    return r.err / r.tol
