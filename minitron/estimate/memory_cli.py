"""python -m minitron.estimate memory: where one rank's memory goes in a training step, by component.

The estimator is minitron/estimate/memory.py (its docstring says what is counted and how);
this is its command line.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

from ..pipeline.schedules import SCHEDULES
from .activations import RECOMPUTE
from .memory import DTYPES, PRESETS, ZERO2_SYNC, Setup, preset, rank_params, table


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minitron.estimate memory", description=__doc__.split("\n")[0])
    m = p.add_argument_group("model")
    m.add_argument("--model", default="gpt2-small", help=f"preset: {', '.join(PRESETS)}")
    for opt in ("layers", "hidden", "heads", "vocab"):
        m.add_argument(f"--{opt}", type=int, default=None, help="override the preset's")
    c = p.add_argument_group("configuration")
    for opt in ("tp", "pp", "dp", "cp", "ep", "virtual"):
        c.add_argument(f"--{opt}", type=int, default=1)
    c.add_argument("--sp", action="store_true", help="sequence parallelism")
    c.add_argument("--regather", action="store_true",
                   help="with --sp: Megatron's re-gather of the QKV/fc1 inputs in backward "
                        "(Korthikanti et al.'s accounting; minitron keeps them gathered)")
    c.add_argument("--schedule", choices=sorted(SCHEDULES), default=None)
    c.add_argument("--microbatches", type=int, default=None, help="per iteration (default pp)")
    c.add_argument("--micro-batch", type=int, default=1, dest="micro_batch")
    c.add_argument("--seq", type=int, default=None)
    c.add_argument("--zero", type=int, default=0, help="ZeRO stage 0-3")
    c.add_argument("--zero2-sync", choices=ZERO2_SYNC, default="last", dest="zero2_sync",
                   help="ZeRO-2 with several micro-batches per step: reduce-scatter after the "
                        "last (minitron: the full gradient accumulates) or after each (DeepSpeed)")
    c.add_argument("--recompute", choices=RECOMPUTE, default="none")
    c.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    c.add_argument("--flash-attention", action="store_true", dest="flash_attention",
                   help="flash attention: no s x s scores kept")
    c.add_argument("--grad-dtype", choices=sorted(DTYPES), default=None, dest="grad_dtype",
                   help="gradients' dtype when it differs (float32: Megatron's main grads)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cfg = preset(args.model)
        sizes = {"n_layers": args.layers, "hidden": args.hidden, "n_heads": args.heads,
                 "vocab_size": args.vocab}
        cfg = dataclasses.replace(cfg, **{k: v for k, v in sizes.items() if v is not None})
        su = Setup(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Setup)})
        text = table(cfg, su)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.model}: layers={cfg.n_layers} hidden={cfg.hidden} heads={cfg.n_heads} "
          f"vocab={cfg.vocab_size} seq={args.seq or cfg.seq_len}; {su}")
    print(f"pipeline rank 0, per rank ({rank_params(cfg, su.tp, su.pp, su.virtual):,} parameters):")
    print(text)
    return 0

