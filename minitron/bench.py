"""python -m minitron.bench overhead | kernels

overhead: what the parallel machinery costs when there is nothing to split. ParallelGPT at
tp=1 (a world of one rank: every mapping is the identity, every collective is skipped) and the
reference GPT train on the same batch in the same process, one full step each (forward,
backward, AdamW), alternating so that both see the same machine state, several repeats; the
medians are compared. Target: parallel / reference <= 1.10.

kernels: the fused Triton kernels' benchmark (minitron.kernels.bench), when it is installed.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

from .grid import ParallelConfig, build_grid
from .launch import launch
from .model.config import ModelConfig
from .model.parallel import ParallelGPT
from .model.reference import GPT
from .verify import make_batch, parallel_step, reference_step

TARGET = 1.10
OVERHEAD_CONFIG = ModelConfig(vocab_size=2048, seq_len=128, hidden=256, n_layers=4, n_heads=8,
                              dropout=0.1)


def _time_step(step) -> float:
    t0 = time.perf_counter()
    step()
    return time.perf_counter() - t0


def _overhead_rank(cfg: ModelConfig, batch: int, repeats: int, warmup: int) -> dict:
    grid = build_grid(ParallelConfig(tp=1))
    ref = GPT(cfg, seed=0)
    par = ParallelGPT.from_reference(ref, grid)
    opts = {m: torch.optim.AdamW(m.parameters(), lr=1e-4) for m in (ref, par)}
    tokens, targets = make_batch(0, 0, batch, cfg.seq_len, cfg.vocab_size)

    def train_step(model):
        def run():
            if model is ref:
                reference_step(ref, tokens, targets, 0)
            else:
                parallel_step(par, tokens, targets, 0)
            opts[model].step()
            opts[model].zero_grad(set_to_none=True)
        return run

    times = {"reference": [], "parallel": []}
    for i in range(warmup + repeats):
        # Alternate which goes first, so neither always runs on a warmer cache.
        order = [("reference", ref), ("parallel", par)]
        for name, model in (order if i % 2 == 0 else order[::-1]):
            t = _time_step(train_step(model))
            if i >= warmup:
                times[name].append(t)
    return {"times": times, "threads": torch.get_num_threads()}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{cpu}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}")


def overhead(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minitron.bench overhead")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    args = p.parse_args(argv)
    cfg = OVERHEAD_CONFIG
    # gloo: both models on the CPU. On a GPU machine launch would pick nccl for one rank and put
    # ParallelGPT on the GPU, next to a reference and a batch still on the CPU.
    out = launch(_overhead_rank, cfg, args.batch, args.repeats, args.warmup, world_size=1,
                 backend="gloo")[0]
    ref_ms = 1e3 * statistics.median(out["times"]["reference"])
    par_ms = 1e3 * statistics.median(out["times"]["parallel"])
    ratio = par_ms / ref_ms
    print(f"machine: {machine()}")
    print(f"config:  {cfg}")
    print(f"step:    forward + backward + AdamW, batch {args.batch} x {cfg.seq_len} tokens, float32, "
          f"{out['threads']} thread(s), median of {args.repeats} interleaved repeats "
          f"after {args.warmup} warm-up")
    print(f"reference GPT             {ref_ms:9.2f} ms")
    print(f"ParallelGPT, tp=1         {par_ms:9.2f} ms")
    verdict = "met" if ratio <= TARGET else "NOT met"
    print(f"ratio parallel/reference  {ratio:9.3f}   (target <= {TARGET:.2f}: {verdict})")
    return 0


def kernels(argv: list[str]) -> int:
    try:
        from .kernels import bench as kernel_bench
    except ImportError as e:
        print(f"the kernel benchmarks are not installed (minitron.kernels.bench: {e})", file=sys.stderr)
        return 1
    return kernel_bench.run(argv) or 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"overhead": overhead, "kernels": kernels}
    if not argv or argv[0] not in commands:
        print(f"usage: python -m minitron.bench {{{','.join(commands)}}} [options]\n\n{__doc__}",
              file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
