"""python -m minitron.verify --matrix [--quick]: every combination of the dimensions, verified.

Every (tp, pp, dp, cp, ep) with each size in {1, 2} and at most 8 ranks (26 configurations),
with sequence parallelism wherever tp is 2 and a mixture of experts wherever ep is 2, and,
rotating through the rows so that each appears: the 1F1B, ZB-H1 and interleaved schedules in
pipeline rows, ZeRO stages 0, 1 and 3 in data-parallel rows (experts too), each
context-parallel variant, and bfloat16 in some rows. Each row is one
`verify()` run: logits, loss, dL/dX, every gradient, every updated weight and the bitwise
equality of every replica, against the single-device reference. A combination the engine does
not run yet is printed as refused, with its row of minitron/refusals.py (the one table the
engine and the command lines refuse from); any other error ends the matrix.

`--plant KIND` puts one planted bug (verify/plants.py) into every row that holds its dimension
(PLANT_DIMENSION: a tensor-parallel replica drifting, a stage sending back a stale gradient,
a bucket never reduced, the ring's merge without its rescale, a token sent to the wrong expert):
each of those rows must FAIL. The rows without that dimension run as they are and must PASS;
the command exits 0 only if both hold.
"""
from __future__ import annotations

import dataclasses
import itertools
import time

import torch

from ..grid import ParallelConfig
from ..config import ModelConfig
from ..refusals import Refused
from .run import verify

SIZES = (1, 2)
DIMS = ("tp", "pp", "dp", "cp", "ep")
MAX_WORLD = 8
SCHEDULES = ("1f1b", "zb-h1", "interleaved")
ZERO_STAGES = (0, 1, 3)
CP_VARIANTS = ("ring", "allgather", "ulysses")
# The dimension each plant breaks: exactly the rows that contain it must fail.
PLANT_DIMENSION = {"replica-drift": "tp", "pp-stale-grad": "pp", "dp-bucket": "dp",
                   "cp-no-rescale": "cp", "moe-split": "ep"}
QUICK = [dict(tp=2, pp=2, dp=2), dict(cp=2, ep=2, dp=2), dict(tp=2, cp=2, pp=2),
         dict(tp=2, ep=2), dict(dp=2, cp=2), dict(pp=2, ep=2), dict()]


@dataclasses.dataclass
class Case:
    sizes: dict
    schedule: str | None
    zero: int | None
    cp_variant: str
    dtype: torch.dtype

    @property
    def world(self) -> int:
        return self.sizes["tp"] * self.sizes["pp"] * self.sizes["dp"] * self.sizes["cp"] * self.sizes["ep"]

    def label(self) -> str:
        parts = [f"{d}{self.sizes[d]}" for d in DIMS if self.sizes[d] > 1] or ["one device"]
        if self.sizes["tp"] > 1:
            parts[0] += "+sp"
        extra = [self.schedule, None if self.zero is None else f"zero{self.zero}",
                 self.cp_variant if self.sizes["cp"] > 1 else None,
                 "moe" if self.sizes["ep"] > 1 else None,
                 "bf16" if self.dtype == torch.bfloat16 else None]
        return " ".join(parts + [e for e in extra if e])


def cases(quick: bool = False) -> list[Case]:
    """The configurations, in a fixed order (the rotations depend on it)."""
    grids = []
    for values in itertools.product(SIZES, repeat=len(DIMS)):
        sizes = dict(zip(DIMS, values))
        world = 1
        for v in values:
            world *= v
        if world <= MAX_WORLD:
            grids.append(sizes)
    out = []
    for k, sizes in enumerate(grids):
        pipeline, dp, moe = sizes["pp"] > 1, sizes["dp"] > 1, sizes["ep"] > 1
        schedule = SCHEDULES[k % len(SCHEDULES)] if pipeline else None
        zero = ZERO_STAGES[k % len(ZERO_STAGES)] if dp else None
        bf16 = k % 4 == 2 and not moe
        out.append(Case(sizes, schedule, zero, CP_VARIANTS[k % len(CP_VARIANTS)],
                        torch.bfloat16 if bf16 else torch.float32))
    if quick:                      # the same rows as in the whole matrix, a few of them
        wanted = [{**{d: 1 for d in DIMS}, **q} for q in QUICK]
        out = [c for c in out if c.sizes in wanted]
    return out


def model_for(case: Case) -> ModelConfig:
    return ModelConfig(vocab_size=128, seq_len=16, hidden=64, n_layers=4, n_heads=4, dropout=0.1,
                       n_experts=4 if case.sizes["ep"] > 1 else 0, topk=2)


@dataclasses.dataclass
class Result:
    case: Case
    verdict: str          # PASS, FAIL or refused
    comparisons: int = 0
    worst: float = float("nan")
    margin: float = float("nan")
    seconds: float = 0.0
    why: str = ""


def run_case(case: Case, steps: int = 2, plant: str | None = None) -> Result:
    s = case.sizes
    if plant is not None and s[PLANT_DIMENSION[plant.split(":")[0]]] == 1:
        plant = None                       # not this row's dimension: it runs clean
    if plant == "dp-bucket":               # a bucket of plain data parallelism (ZeRO 0)
        case = dataclasses.replace(case, zero=0)
    pcfg = ParallelConfig(tp=s["tp"], pp=s["pp"], dp=s["dp"], cp=s["cp"], ep=s["ep"],
                          sequence_parallel=s["tp"] > 1, cp_variant=case.cp_variant,
                          virtual_pp=2 if case.schedule == "interleaved" else 1)
    t0 = time.perf_counter()
    try:
        report = verify(pcfg, model_for(case), steps, dtype=case.dtype, schedule=case.schedule,
                        microbatches=4 if case.schedule else None, zero=case.zero, plant=plant)
    except Refused as e:
        return Result(case, "refused", why=f"{e.name}: {e.as_flags()}")
    rows = report.rows
    bounded = [r for r in rows if r.tol > 0 and r.err > 0]
    margin = min((r.tol / r.err for r in bounded), default=float("inf"))
    verdict = "PASS" if report.passed else "FAIL"
    return Result(case, verdict, len(rows), report.max_rel_err, margin, time.perf_counter() - t0,
                  "" if report.passed else report.verdict())


def table(results: list[Result]) -> str:
    width = max(len(r.case.label()) for r in results)
    lines = [f"{'configuration':<{width}}  {'ranks':>5}  {'compared':>8}  {'worst rel err':>13}  "
             f"{'margin':>7}  {'verdict':<7}  {'seconds':>7}"]
    for r in results:
        if r.verdict == "refused":
            lines.append(f"{r.case.label():<{width}}  {r.case.world:>5}  {'-':>8}  {'-':>13}  "
                         f"{'-':>7}  refused  {'-':>7}  {r.why}")
            continue
        margin = f"{r.margin:6.0f}x" if r.margin != float("inf") else f"{'-':>7}"
        lines.append(f"{r.case.label():<{width}}  {r.case.world:>5}  {r.comparisons:>8}  "
                     f"{r.worst:13.2e}  {margin}  {r.verdict:<7}  {r.seconds:7.1f}"
                     + (f"  {r.why}" if r.why else ""))
    counts = {v: sum(r.verdict == v for r in results) for v in ("PASS", "FAIL", "refused")}
    lines.append(f"{len(results)} configurations: {counts['PASS']} PASS, {counts['FAIL']} FAIL, "
                 f"{counts['refused']} refused")
    return "\n".join(lines)


def run(quick: bool = False, steps: int = 2, plant: str | None = None, show=print) -> list[Result]:
    results = []
    for case in cases(quick):
        results.append(run_case(case, steps, plant))
        show(f"  {results[-1].case.label()}: {results[-1].verdict}", flush=True)
    return results


def as_expected(results: list[Result], plant: str | None) -> bool:
    """No row fails (plain); with a plant, exactly the rows of its dimension fail."""
    if plant is None:
        return all(r.verdict != "FAIL" for r in results)
    dim = PLANT_DIMENSION[plant.split(":")[0]]
    return all(r.verdict == ("FAIL" if r.case.sizes[dim] > 1 else "PASS")
               for r in results if r.verdict != "refused")
