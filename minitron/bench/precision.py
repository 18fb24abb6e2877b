"""python -m minitron.bench precision: the same short training run in float32, bf16 and FP8
(per-tensor delayed and current scaling, blockwise 1x128 / 128x128 tiles, mxfp8 32-blocks).

Every run goes through the one engine (train/engine.py TrainingRun) on one CPU rank, from the
same initial weights (bf16-rounded, so every run starts from the same numbers), on the same
batches of the shipped corpus (data/corpus.txt), with the same learning-rate schedule: only
the precision differs (train.precision.resolve_precision). Then bf16 again, --nudges times,
with every initial weight nudged by about one bf16 rounding (relative 2^-9): the spread of bf16
and its nudged copies is the yardstick. A precision's gap that stays inside it is not a difference this small run can show: rounding in any precision sends
the trajectory elsewhere, and a run's final loss wanders by about that much (the same command
on another CPU's kernels, ATEN_CPU_CAPABILITY=default or avx2, moves the 16-bit and FP8 gaps
by up to 0.02). Writes the per-step losses to a CSV
(bench/results/precision_fp8.csv, headed by the date and the command) and the curves overlaid
(lessons/figures/fp8_loss_curves.png), and prints the gap: each run's mean training loss
over the last `--tail` steps and its held-out loss, against float32's.

Then, side by side, what one cast costs each FP8 recipe on an activation with outliers
(quantization_errors): one scale per tensor (current scaling), per 1x128 tile (blockwise) and
per 32-element E8M0 block (mxfp8); `--quantization` prints that table alone, without training.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch

from ..grid import ParallelConfig
from ..config import ModelConfig
from ..model.reference import GPT
from ..runtime.launch import launch
from ..train import data
from ..train.engine import TrainingRun
from ..train.precision import resolve_precision
from ..train.lr import learning_rate
from ..tensor_parallel.fp8 import E4M3, amax, dequantize, quantize, scale_from_amax
from ..tensor_parallel.fp8_blocks import quantize_blocks

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
# The fine-grained recipes at hidden 64: a 1x128 tile of an activation is its whole row (one
# scale per token), a 128x128 weight block a 128-row band of the whole 64-wide matrix.
RUNS = {"float32": ("float32", None), "bfloat16": ("bfloat16", None),
        "fp8 delayed": ("fp8", "delayed"), "fp8 current": ("fp8", "current"),
        "fp8 blockwise": ("fp8", "blockwise"), "fp8 mxfp8": ("fp8", "mxfp8")}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minitron.bench precision", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--nudges", type=int, default=3,
                   help="bf16 runs with the initial weights nudged by one bf16 rounding (the yardstick)")
    p.add_argument("--tail", type=int, default=20, help="steps the final training loss is averaged over")
    p.add_argument("--csv", default=os.path.join(ROOT, "bench", "results", "precision_fp8.csv"))
    p.add_argument("--figure", default=os.path.join(ROOT, "lessons", "figures", "fp8_loss_curves.png"))
    p.add_argument("--quantization", action="store_true",
                   help="print only the quantization errors of the FP8 recipes (no training)")
    return p


def outlier_activation(ratio: float, tokens: int = 256, features: int = 512, seed: int = 0):
    """[tokens, features] bf16 values of std 1, and 8 entries `ratio` times that."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, features, generator=g)
    x[torch.randint(0, tokens, (8,), generator=g), torch.randint(0, features, (8,), generator=g)] = ratio
    return x.bfloat16().float()


def _per_tensor(x: torch.Tensor) -> torch.Tensor:
    """x cast with one scale, 448 / its amax (current scaling), and back."""
    s = scale_from_amax(amax(x), E4M3)
    return dequantize(quantize(x, s, E4M3), s)


def quantization_errors(ratios=(1e2, 1e4, 1e6)) -> dict[float, dict[str, tuple[float, float]]]:
    """{ratio: {recipe: (relative error of every entry, of all but the outliers)}} of one E4M3
    cast of outlier_activation(ratio): ||x - dequant(cast(x))|| / ||x||."""
    casts = {"per-tensor": _per_tensor,
             "blockwise 1x128": lambda x: quantize_blocks(x, E4M3, 1, 128, pow2=False).dequantize(),
             "mxfp8 1x32": lambda x: quantize_blocks(x, E4M3, 1, 32, pow2=True).dequantize()}
    out = {}
    for ratio in ratios:
        x = outlier_activation(ratio)
        rest = x.abs() < ratio / 2
        err = lambda e, m: float(e[m].norm() / x[m].norm())
        out[ratio] = {name: (err(c(x) - x, torch.ones_like(rest)), err(c(x) - x, rest))
                      for name, c in casts.items()}
    return out


def quantization_table(errors: dict) -> list[str]:
    names = list(next(iter(errors.values())))
    lines = ["one E4M3 cast of a [256, 512] activation (std 1) with 8 outliers: relative error, "
             "all entries / all but the outliers",
             f"{'outliers':>9} " + " ".join(f"{n:>22}" for n in names)]
    for ratio, row in errors.items():
        lines.append(f"{ratio:>8.0e}x " + " ".join(f"{a:>10.2e} / {r:>9.2e}" for a, r in row.values()))
    return lines


def train_all(args) -> dict[str, dict]:
    """One rank: every run of RUNS in turn; {name: {'loss': [per step], 'held_out': float}}."""
    tokens = data.encode(open(os.path.join(ROOT, "data", "corpus.txt"), encoding="utf-8").read())
    train, val = data.split(tokens)
    loader, held = data.Loader(train, args.batch, args.seq, 0), data.Loader(val, args.batch, args.seq, 1)
    mcfg = ModelConfig(vocab_size=data.VOCAB_SIZE, seq_len=args.seq, hidden=args.hidden,
                       n_layers=args.layers, n_heads=4)
    def train(dtype_name, recipe, nudge=0):
        dtype, fp8 = resolve_precision(dtype_name, recipe)
        start = GPT(mcfg, seed=0).to(torch.bfloat16).float()     # the same numbers for every run
        if nudge:          # every weight moved by about one bf16 rounding (relative 2^-9)
            g = torch.Generator().manual_seed(nudge)
            with torch.no_grad():
                for p in start.parameters():
                    p.mul_(1 + torch.randn(p.shape, generator=g) * 2.0 ** -9)
        run = TrainingRun(mcfg, ParallelConfig(), dtype=dtype, fp8=fp8, lr=args.lr, reference=start)
        losses = []
        for step in range(args.steps):
            run.set_lr(learning_rate(step, peak=args.lr, steps=args.steps, warmup=args.steps // 10,
                                     min_lr=args.lr / 10))
            losses.append(run.step(*loader.batch(step), step))
        held_out = sum(run.evaluate(*held.batch(k)) for k in range(4)) / 4
        return {"loss": losses, "held_out": held_out}

    out = {name: train(dtype_name, recipe) for name, (dtype_name, recipe) in RUNS.items()}
    # The yardstick: bf16 again, its initial weights nudged by one bf16 rounding: how far a
    # perturbation of a rounding's size alone carries the run (the spread a gap must exceed)
    out.update({f"bfloat16 nudged {k}": train("bfloat16", None, k) for k in range(1, args.nudges + 1)})
    return out


def write_csv(path: str, results: dict, command: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    names = list(results)
    with open(path, "w") as f:
        f.write(f"# date: {datetime.date.today().isoformat()}\n# command: {command}\n")
        f.write("# held-out loss: " + ", ".join(f"{n} {r['held_out']:.4f}" for n, r in results.items()) + "\n")
        f.write("step," + ",".join(n.replace(" ", "_") for n in names) + "\n")
        for step in range(len(results[names[0]]["loss"])):
            f.write(f"{step}," + ",".join(f"{results[n]['loss'][step]:.5f}" for n in names) + "\n")


def plot(path: str, results: dict, tail: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (full, end) = plt.subplots(1, 2, figsize=(11, 4))
    window = min(4 * tail, len(next(iter(results.values()))["loss"]))
    for name, r in results.items():
        if " nudged " in name:
            continue
        loss = r["loss"]
        full.plot(loss, label=name, lw=1)
        end.plot(range(len(loss) - window, len(loss)), loss[-window:], label=name, lw=1)
    full.set(xlabel="step", ylabel="training loss", title="the same run in each precision")
    end.set(xlabel="step", title=f"the last {window} steps")
    full.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=100)


def gaps(results: dict, tail: int) -> list[str]:
    """Each run's tail and held-out loss against float32's, then the spread of float32 itself
    nudged by one rounding: a precision's gap inside that spread is not one this run can see."""
    base = results["float32"]
    ref_tail = sum(base["loss"][-tail:]) / tail
    lines = [f"{'run':<16} {'train loss (last %d)' % tail:>22} {'vs float32':>11} {'held-out':>9} {'vs float32':>11}"]
    for name, r in results.items():
        t = sum(r["loss"][-tail:]) / tail
        lines.append(f"{name:<16} {t:22.4f} {t - ref_tail:+11.4f} {r['held_out']:9.4f} "
                     f"{r['held_out'] - base['held_out']:+11.4f}")
    seeds = [r for n, r in results.items() if n.startswith("bfloat16")]
    if len(seeds) > 1:
        tails = [sum(r["loss"][-tail:]) / tail for r in seeds]
        held = [r["held_out"] for r in seeds]
        lines.append(f"bfloat16 and {len(seeds) - 1} nudged copies: train loss spread (max - min) "
                     f"{max(tails) - min(tails):.4f}, held-out {max(held) - min(held):.4f}")
    return lines


def run(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.quantization:
        print("\n".join(quantization_table(quantization_errors())))
        return 0
    results = launch(train_all, args, world_size=1)[0]
    command = "python -m minitron.bench precision " + " ".join(argv)
    write_csv(args.csv, results, command.strip())
    plot(args.figure, results, args.tail)
    print("\n".join(gaps(results, args.tail)))
    print("\n".join(quantization_table(quantization_errors())))
    print(f"wrote {os.path.relpath(args.csv)} and {os.path.relpath(args.figure)}")
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
