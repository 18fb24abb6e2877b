"""The margins of the low-precision verdicts, over seeds: how far a correct split passes and how
far each plant fails, in bfloat16, float16 and FP8 under each recipe (the measurement behind
the constants of minitron/verify/noise_rows.py and fp8_rows.py).

    python tools/verdict_margins.py [--seeds 0 1 2 3] [--only bfloat16 fp8-current ...]

Each line: a precision and a plant (or none), each seed's margin, the smallest, and the row that
set it. A correct run's margin is its smallest tol/err (PASS needs > 1); a plant's is its largest
err/tol (FAIL needs > 1). The aim is 3 or more both ways. The shape is small, so that the whole
table runs in a few minutes on two cores: tp 2 with SP, vocab 64, seq 8, hidden 32, 2 layers,
4 heads, dropout 0.1, 2 steps (the command line below prints each run's own).

Known under 3: grad under FP8 (3.9%, as in bfloat16) fails by only 0.3-0.8 at seeds 0-1, i.e.
passes: the gradients of FP8 GEMMs (E5M2 operands in dW) carry FP8's own noise, so along the
reference a 3.9% error is 4.5-12 noise units where correct FP8 splits reach 3.0. The table says so
rather than hiding it.
"""
from __future__ import annotations

import argparse
import math

import torch

from minitron.config import ModelConfig
from minitron.grid import ParallelConfig
from minitron.train.precision import resolve_precision
from minitron.verify import verify
from minitron.verify.report import _ratio

SHAPE = dict(vocab_size=64, seq_len=8, hidden=32, n_layers=2, n_heads=4, dropout=0.1)
FLAGS = "--tp 2 --sp --vocab 64 --seq 8 --hidden 32 --layers 2 --heads 4 --dropout 0.1 --steps 2"
PLANTS = {
    "bfloat16": [None, "grad", "update"],
    "float16": [None, "grad", "update", "fp16-unscaled-loss"],
    "fp8-delayed": [None, "grad", "fp8-unscaled", "fp8-e5m2-forward", "fp8-stale-amax", "fp8-wrong-amax",
                    "fp8-double-scale"],
    "fp8-current": [None, "grad", "fp8-unscaled", "fp8-e5m2-forward", "fp8-wrong-amax", "fp8-double-scale"],
    "fp8-blockwise": [None, "fp8-block-per-tensor", "fp8-block-wrong-dim"],
    "fp8-mxfp8": [None, "fp8-block-per-tensor", "fp8-mx-scale-not-pow2", "fp8-block-wrong-dim"],
}


def precision(name: str):
    """(dtype, FP8Recipe or None) of a PLANTS key."""
    if name.startswith("fp8-"):
        return resolve_precision("fp8", name[len("fp8-"):])
    return getattr(torch, name), None


def margin(report, plant: str | None) -> tuple[float, str]:
    """(margin, the row that set it): correct, min tol/err; planted, max err/tol."""
    w = max(report.rows, key=_ratio)
    if plant is None:
        return (1 / _ratio(w) if _ratio(w) else math.inf), f"step {w.step} {w.quantity}"
    return _ratio(w), f"step {w.step} {w.quantity}"


def command(name: str, plant: str | None, seed: int) -> str:
    dtype = f"--dtype fp8 --fp8-recipe {name[4:]}" if name.startswith("fp8-") else f"--dtype {name}"
    return (f"python -m minitron.verify {FLAGS} {dtype} --seed {seed}"
            + (f" --plant {plant}" if plant else ""))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--only", nargs="+", choices=sorted(PLANTS), default=sorted(PLANTS))
    args = ap.parse_args(argv)
    print(f"shape: {FLAGS}; seeds {' '.join(map(str, args.seeds))}; e.g. {command('bfloat16', 'grad', 0)}")
    short = []
    for name in args.only:
        dtype, fp8 = precision(name)
        for plant in PLANTS[name]:
            found = [margin(verify(ParallelConfig(tp=2, sequence_parallel=True), ModelConfig(**SHAPE),
                                   2, dtype=dtype, fp8=fp8, seed=seed, plant=plant), plant)
                     for seed in args.seeds]
            low = min(found)
            print(f"{name:<14} {plant or 'correct':<22} " + " ".join(f"{m:7.2f}" for m, _ in found)
                  + f"   min {low[0]:6.2f}  {low[1]}", flush=True)
            if low[0] < 3:
                short.append(f"{name} {plant or 'correct'}")
    print("every margin >= 3" if not short else f"under 3: {', '.join(short)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
