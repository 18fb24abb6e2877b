"""python -m minitron.estimate flops: FLOPs of one training iteration, and tokens/s, MFU and HFU.

The counting is minitron/estimate/flops.py (Narayanan et al.'s formula, term by term); this is
its command line. The named shapes are estimate/memory.py's presets.
"""
from __future__ import annotations

import argparse
import sys

from .activations import RECOMPUTE
from .flops import detect_peak, iteration_flops, throughput
from .memory import PRESETS, preset


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minitron.estimate flops", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt3-175b", help=f"preset: {', '.join(PRESETS)}")
    p.add_argument("--batch", type=int, default=1, help="sequences per iteration (global)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the preset's)")
    p.add_argument("--recompute", choices=RECOMPUTE, default="full")
    p.add_argument("--seconds", type=float, default=None, help="measured time of one iteration")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--peak", type=float, default=None,
                   help="peak FLOP/s per GPU (default: detected for a known GPU)")
    args = p.parse_args(argv)
    try:
        cfg = preset(args.model)
        flops = iteration_flops(cfg, args.batch, args.seq, args.recompute)
        model_flops = iteration_flops(cfg, args.batch, args.seq, "none")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.model}: layers={cfg.n_layers} hidden={cfg.hidden} heads={cfg.n_heads} "
          f"vocab={cfg.vocab_size} seq={args.seq or cfg.seq_len} batch={args.batch}")
    print(f"FLOPs per iteration: {flops:.4g} (recompute={args.recompute}), "
          f"{model_flops:.4g} without recomputation (model FLOPs)")
    if args.seconds:
        peak, where = args.peak, "given"
        if peak is None and (found := detect_peak()):
            peak, where = found[0], f"detected: {found[1]}"
        rates = throughput(cfg, args.batch, args.seconds, args.gpus, peak, args.recompute, args.seq)
        line = ", ".join(f"{k} {v:.4g}" for k, v in rates.items())
        print(line + ("" if peak else "  (no peak: pass --peak to get MFU)")
              + (f"  [peak {peak:.4g} FLOP/s, {where}]" if peak else ""))
    return 0

