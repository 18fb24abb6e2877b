"""python -m minitron.verify --matrix [--quick]: every combination of the dimensions, verified.

Every (tp, pp, dp, cp, ep) with each size in {1, 2} and at most 8 ranks (26 configurations),
with sequence parallelism wherever tp is 2 and a mixture of experts wherever ep is 2, and,
rotating through the rows so that each appears: the 1F1B, ZB-H1 and interleaved schedules in
pipeline rows, ZeRO stages 0, 1 and 3 in data-parallel rows (experts too), each
context-parallel variant, and bfloat16 in some rows. Each row is one
`verify()` run: logits, loss, dL/dX, every gradient, every updated weight and the bitwise
equality of every replica, against the single-device reference. A combination the engine does
not run yet is printed as refused, with its row of minitron/refusals/ (the one table the
engine and the command lines refuse from); any other error ends the matrix.

After the grid's rows come the features, each composed with other dimensions (FEATURES): hybrid
sharding (--dp-shard) under tp2+SP x pp2, hierarchical context parallelism (Ulysses in pairs, a
ring across) with dp, overlapped TP under pp and dp, FP8 with both recipes (delayed under pp2 x
dp2, current under tp2+SP x cp2), the fine-grained FP8 recipes (blockwise under tp2+SP x dp2,
MXFP8 under pp2 x dp2), FP8 experts (ep2 x dp2), DualPipeV under tp2+SP and with experts under
ep2 (its overlapped (F, BW) pairs hiding the all-to-all, pipeline/pairs.py), full and selective
recomputation, the fused kernels (Triton's interpreter on CPU ranks) under tp2+SP x dp2, aux-
loss-free balancing (ep2 x dp2) and node-limited routing (ep2 x pp2, each token's experts on
one of the two ep ranks).

The model is the matrix's own (vocab 128, seq 16, hidden 64, 4 layers, 4 heads) unless the
model options say otherwise (`--vocab 1002 --hidden 200 --heads 8 --kv-heads 2 --seq 24`); the
shape used is printed first, and a row the shape cannot be split into is shown as `no fit`
with the reason (model/splits.py), not run.

`--plant KIND` puts one planted bug (verify/plants.py) into every row that holds its dimension
(PLANT_DIMENSION: a tensor-parallel replica drifting, a stage sending back a stale gradient,
a bucket never reduced, the ring's merge without its rescale, a token sent to the wrong expert):
each of those rows must FAIL. The rows without that dimension run as they are and must PASS;
the command exits 0 only if both hold.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import time

import torch

from ..grid import ParallelConfig
from ..config import ModelConfig
from ..model.fused import enable_kernels
from ..model.splits import validate_model
from ..refusals import Refused
from ..train.precision import resolve_precision
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


DEFAULT_MODEL = ModelConfig(vocab_size=128, seq_len=16, hidden=64, n_layers=4, n_heads=4, dropout=0.1)


@dataclasses.dataclass
class Case:
    sizes: dict
    schedule: str | None
    zero: int | None
    cp_variant: str
    dtype: torch.dtype
    # the features (FEATURES): ParallelConfig fields (dp_shard, cp_a2a, tp_comm_overlap),
    # ModelConfig fields (MODEL_OPTIONS) and "fp8": a recipe name
    options: dict = dataclasses.field(default_factory=dict)

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
                 "bf16" if self.dtype == torch.bfloat16 and "fp8" not in self.options else None]
        o = self.options
        extra += [f"hsdp(shard {o['dp_shard']})" if "dp_shard" in o else None,
                  f"a2a{o['cp_a2a']}" if "cp_a2a" in o else None,
                  "tp-overlap" if o.get("tp_comm_overlap") else None,
                  f"fp8-{o['fp8']}" if "fp8" in o else None,
                  f"recompute-{o['recompute']}" if "recompute" in o else None,
                  "kernels" if o.get("use_kernels") else None,
                  "aux-free" if o.get("expert_bias") else None,
                  f"max-nodes {o['max_groups']}" if "max_groups" in o else None]
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
    return out + features()


def _sizes(**kw) -> dict:
    return {**{d: 1 for d in DIMS}, **kw}


BF16, FP32 = torch.bfloat16, torch.float32
# (sizes, schedule, zero, cp_variant, dtype, options): every feature composed with other dimensions
FEATURES = [
    (_sizes(tp=2, pp=2, dp=2), "1f1b", 1, "ring", BF16, {"dp_shard": 1}),            # HSDP
    (_sizes(cp=4, dp=2), None, 0, "hierarchical", FP32, {"cp_a2a": 2}),
    (_sizes(tp=2, pp=2, dp=2), "1f1b", 0, "ring", FP32, {"tp_comm_overlap": True}),
    (_sizes(pp=2, dp=2), "1f1b", 1, "ring", BF16, {"fp8": "delayed"}),
    (_sizes(tp=2, cp=2), None, None, "ring", BF16, {"fp8": "current"}),
    (_sizes(tp=2, pp=2), "dualpipev", None, "ring", FP32, {}),
    (_sizes(pp=2, ep=2), "dualpipev", None, "ring", FP32, {}),     # experts, overlapped pairs
    (_sizes(tp=2, pp=2), "1f1b", None, "ring", FP32, {"recompute": "full"}),
    (_sizes(dp=2, pp=2), "1f1b", 3, "ring", BF16, {"recompute": "selective"}),
    (_sizes(tp=2, dp=2), None, 1, "ring", FP32, {"use_kernels": True}),
    (_sizes(tp=2, dp=2), None, 1, "ring", BF16, {"fp8": "blockwise"}),
    (_sizes(pp=2, dp=2), "1f1b", 0, "ring", BF16, {"fp8": "mxfp8"}),
    (_sizes(ep=2, dp=2), None, 1, "ring", BF16, {"fp8": "current"}),             # FP8 experts
    (_sizes(ep=2, dp=2), None, 1, "ring", FP32, {"expert_bias": True}),          # aux-loss-free
    (_sizes(ep=2, pp=2), "1f1b", None, "ring", FP32, {"max_groups": 1}),         # node-limited
]


def features() -> list[Case]:
    return [Case(sizes, schedule, zero, variant, dtype, dict(options))
            for sizes, schedule, zero, variant, dtype, options in FEATURES]


MODEL_OPTIONS = ("recompute", "use_kernels", "expert_bias", "max_groups")


def model_for(case: Case, base: ModelConfig = DEFAULT_MODEL) -> ModelConfig:
    """The base model (the matrix's own, or the command line's shape), with experts in ep rows
    and the row's model features."""
    model = {k: v for k, v in case.options.items() if k in MODEL_OPTIONS}
    if "max_groups" in model:               # the experts in one group per ep rank ("node")
        model["expert_groups"] = case.sizes["ep"]
    return dataclasses.replace(base, n_experts=4 if case.sizes["ep"] > 1 else 0, topk=2, **model)


@dataclasses.dataclass
class Result:
    case: Case
    verdict: str          # PASS, FAIL or refused
    comparisons: int = 0
    worst: float = float("nan")
    margin: float = float("nan")
    seconds: float = 0.0
    why: str = ""


@contextlib.contextmanager
def _interpreter_setting_kept():
    """TRITON_INTERPRET as it was on entry, again on exit. enable_kernels sets it for the kernels
    rows' ranks; left set, every later row's ranks would step their optimizer through the
    Triton interpreter too (ops.fused_adamw_step reads it on every call), a row without
    kernels then taking 2x its CPU time for a path it does not claim to test."""
    before = os.environ.get("TRITON_INTERPRET")
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before


def run_case(case: Case, steps: int = 2, plant: str | None = None,
             base: ModelConfig = DEFAULT_MODEL) -> Result:
    with _interpreter_setting_kept():
        return _run_case(case, steps, plant, base)


def _run_case(case: Case, steps: int, plant: str | None, base: ModelConfig) -> Result:
    s = case.sizes
    if plant is not None and s[PLANT_DIMENSION[plant.split(":")[0]]] == 1:
        plant = None                       # not this row's dimension: it runs clean
    if plant == "dp-bucket":               # a bucket of plain data parallelism (ZeRO 0)
        case = dataclasses.replace(case, zero=0)
    grid = {k: v for k, v in case.options.items() if k in ("dp_shard", "cp_a2a", "tp_comm_overlap")}
    pcfg = ParallelConfig(tp=s["tp"], pp=s["pp"], dp=s["dp"], cp=s["cp"], ep=s["ep"],
                          sequence_parallel=s["tp"] > 1, cp_variant=case.cp_variant,
                          virtual_pp=2 if case.schedule == "interleaved" else 1, **grid)
    mcfg = model_for(case, base)
    dtype, fp8 = (resolve_precision("fp8", case.options["fp8"]) if "fp8" in case.options
                  else (case.dtype, None))
    try:
        validate_model(pcfg, mcfg)
        if mcfg.use_kernels:
            enable_kernels(mcfg, pcfg.world_size)
    except ValueError as e:                # this shape does not split on this row's grid
        return Result(case, "no fit", why=str(e).splitlines()[0])
    t0 = time.perf_counter()
    try:
        report = verify(pcfg, mcfg, steps, dtype=dtype, schedule=case.schedule,
                        microbatches=4 if case.schedule else None, zero=case.zero, plant=plant,
                        fp8=fp8)
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
        if r.verdict in ("refused", "no fit"):
            lines.append(f"{r.case.label():<{width}}  {r.case.world:>5}  {'-':>8}  {'-':>13}  "
                         f"{'-':>7}  {r.verdict:<7}  {'-':>7}  {r.why}")
            continue
        margin = (f"{'-':>7}" if r.margin == float("inf") else   # one decimal where 3x is in question
                  f"{r.margin:6.1f}x" if r.margin < 10 else f"{r.margin:6.0f}x")
        lines.append(f"{r.case.label():<{width}}  {r.case.world:>5}  {r.comparisons:>8}  "
                     f"{r.worst:13.2e}  {margin}  {r.verdict:<7}  {r.seconds:7.1f}"
                     + (f"  {r.why}" if r.why else ""))
    counts = {v: sum(r.verdict == v for r in results) for v in ("PASS", "FAIL", "refused", "no fit")}
    lines.append(f"{len(results)} configurations: {counts['PASS']} PASS, {counts['FAIL']} FAIL, "
                 f"{counts['refused']} refused" + (f", {counts['no fit']} do not fit the shape"
                                                   if counts["no fit"] else ""))
    return "\n".join(lines)


def run(quick: bool = False, steps: int = 2, plant: str | None = None, show=print,
        base: ModelConfig = DEFAULT_MODEL) -> list[Result]:
    results, rows = [], cases(quick)
    for case in rows:     # triton imported under TRITON_INTERPRET=1 (CPU ranks) before any row
        if case.options.get("use_kernels"):            # imports it; set again by that row only
            try:
                with _interpreter_setting_kept():
                    enable_kernels(model_for(case, base), case.world)
            except ValueError:
                pass            # the shape does not suit the kernels: the row says so
    for case in rows:
        results.append(run_case(case, steps, plant, base))
        show(f"  {results[-1].case.label()}: {results[-1].verdict}", flush=True)
    return results


def as_expected(results: list[Result], plant: str | None) -> bool:
    """No row fails (plain); with a plant, exactly the rows of its dimension fail."""
    if plant is None:
        return all(r.verdict != "FAIL" for r in results)
    dim = PLANT_DIMENSION[plant.split(":")[0]]
    return all(r.verdict == ("FAIL" if r.case.sizes[dim] > 1 else "PASS")
               for r in results if r.verdict not in ("refused", "no fit"))
