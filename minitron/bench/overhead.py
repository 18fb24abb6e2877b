"""python -m minitron.bench overhead

overhead: what the parallel machinery costs when there is nothing to split. The reference GPT
(a plain torch loop: forward, loss, backward, torch's AdamW) and each parallel path at size one,
a TrainingRun taking its step as the trainer and the verifier take theirs, train on the same
batch in the same process, one full step each (forward, backward, gradient fix-ups, optimizer),
in a rotating order so that all see the same machine state, several repeats; the medians are
compared:
  ParallelGPT, tp=1                 every mapping the identity, every collective skipped;
                                    no data-parallel engine (torch's AdamW on the model's .grad)
  pipeline pp=1, 1f1b m=1           PipelineGPT's one stage run by the executor from a schedule
                                    (every action timed; activation memory not tracked)
  data parallel dp=1, ZeRO 0/1/3    flat buffers, bucket hooks, ZeroOptimizer's AdamW on the
                                    (here whole) fp32 master shard; ZeRO-3's gather/free hooks
  ParallelGPT MoE, ep=1             the same GPT with 4 experts (top-2) in every layer: router,
                                    all-to-all dispatcher (a group of one) and grouped experts,
                                    against the single-device MoE GPT (its own reference row)
  context parallel cp=1              the context-parallel step as verify and training run it:
                                    the batch cut into its zigzag chunks (one rank: all of it,
                                    in order), positions and masks at their global places,
                                    gradients averaged over the cp group; attention takes the
                                    plain path, as Megatron's does when there is no one to ring
  ring forced on at cp=1            the same, with attention sent through the ring anyway
                                    (ctx.context_parallel): what the ring's machinery costs
                                    with nothing to split. No target: it is paid only when
                                    cp > 1, where the ring replaces attention over the whole
                                    sequence. Its backward recomputes each block's
                                    probabilities (flash-style: only out and lse are saved,
                                    which is what keeps its memory at 1/cp).
Targets: parallel / reference <= 1.05 for every path at size 1: ParallelGPT's, and the pipeline,
data-parallel, context-parallel and expert paths on top of it (none adds arithmetic to the
reference's, so what they cost beyond it is bookkeeping). Both clocks are printed: wall time,
and the process's CPU time, which the ratio uses: every path runs on one thread, so CPU time
is its work, while wall time also counts whatever else the machine runs meanwhile (on a shared
2-core machine, easily 2x). The ratio is the median over rounds of path / reference within
each round (`paired_ratio`), so a slow spell that hits a whole round cancels out.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import time

import torch

from ..grid import ParallelConfig
from ..config import ModelConfig
from ..model.reference import GPT
from ..runtime.launch import launch
from ..train.engine import TrainingRun
from ..verify import make_batch, reference_step

TARGET = 1.05            # every path at size 1: ParallelGPT's and the engines on top of it
OVERHEAD_CONFIG = ModelConfig(vocab_size=2048, seq_len=128, hidden=256, n_layers=4, n_heads=8,
                              dropout=0.1)


def _adamw(model: torch.nn.Module):
    """torch's AdamW on `model`: a function that steps it and clears the gradients."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def _paths(cfg: ModelConfig, batch: int) -> dict:
    """label -> (target, or None for the reference; one training step), all from one reference.
    Every parallel path is one TrainingRun (train/engine.py) taking its step, as the trainer and
    the verifier take theirs; the reference is a plain torch loop on the single-device GPT."""
    tokens, targets = make_batch(0, 0, batch, cfg.seq_len, cfg.vocab_size)

    def reference(model_cfg):
        ref = GPT(model_cfg, seed=0)
        step = _adamw(ref)

        def run():
            reference_step(ref, tokens, targets, 0)
            step()
        return run

    def engine(model_cfg=cfg, force_ring: bool = False, **options):
        # torch AdamW's defaults (weight decay 0.01, no clipping), as the reference steps
        run = TrainingRun(model_cfg, ParallelConfig(), lr=1e-4, eps=1e-8, weight_decay=1e-2,
                          max_norm=None, reference=GPT(model_cfg, seed=0), **options)
        run.model.ctx.context_parallel = force_ring or run.model.ctx.context_parallel
        return lambda: run.step(tokens, targets, 0)

    moe_cfg = dataclasses.replace(cfg, n_experts=4, topk=2)
    # label -> (target or None, step, the row its ratio is taken against or None)
    base = "reference GPT"
    return {base: (None, reference(cfg), None),
            "ParallelGPT, tp=1": (TARGET, engine(zero_stage=None), base),
            "pipeline pp=1, 1f1b m=1": (TARGET, engine(zero_stage=None, schedule="1f1b",
                                                       microbatches=1), base),
            "data parallel dp=1": (TARGET, engine(zero_stage=0), base),
            "ZeRO-1 dp=1": (TARGET, engine(zero_stage=1), base),
            "ZeRO-3 dp=1": (TARGET, engine(zero_stage=3), base),
            "context parallel cp=1": (TARGET, engine(zero_stage=None), base),
            "ring forced on at cp=1": (None, engine(zero_stage=None, force_ring=True), base),
            "MoE reference GPT": (None, reference(moe_cfg), None),
            "ParallelGPT MoE, ep=1": (TARGET, engine(moe_cfg, zero_stage=None), "MoE reference GPT")}


def _overhead_rank(cfg: ModelConfig, batch: int, repeats: int, warmup: int) -> dict:
    paths = _paths(cfg, batch)
    names = list(paths)
    times = {n: {"wall": [], "cpu": []} for n in names}
    for i in range(warmup + repeats):
        # Rotate which goes first, so none always runs on a warmer (or colder) cache.
        k = i % len(names)
        for name in names[k:] + names[:k]:
            w0, c0 = time.perf_counter(), time.process_time()
            paths[name][1]()
            w1, c1 = time.perf_counter(), time.process_time()
            if i >= warmup:
                times[name]["wall"].append(w1 - w0)
                times[name]["cpu"].append(c1 - c0)
    return {"times": times, "targets": {n: (t, against) for n, (t, _, against) in paths.items()},
            "threads": torch.get_num_threads()}


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
    # gloo: every model on the CPU. On a GPU machine launch would pick nccl for one rank and put
    # the parallel models on the GPU, next to a reference and a batch still on the CPU.
    out = launch(_overhead_rank, cfg, args.batch, args.repeats, args.warmup, world_size=1,
                 backend="gloo")[0]
    times = out["times"]
    ms = {n: {c: 1e3 * statistics.median(v) for c, v in t.items()} for n, t in times.items()}
    print(f"machine: {machine()}")
    print(f"config:  {cfg}")
    print(f"step:    forward + backward + optimizer, batch {args.batch} x {cfg.seq_len} tokens, "
          f"float32, {out['threads']} thread(s), median of {args.repeats} rotated rounds after "
          f"{args.warmup} warm-up; ratio: the median over rounds of this path's CPU time over "
          f"the reference's in the same round")
    print(f"{'':30}{'wall ms':>10}{'cpu ms':>10}{'ratio to reference':>20}")
    for name, (target, against) in out["targets"].items():
        row = f"{name:30}{ms[name]['wall']:10.2f}{ms[name]['cpu']:10.2f}"
        if against is not None:
            ratio = paired_ratio(times[name]["cpu"], times[against]["cpu"])
            row += f"{ratio:20.3f}"
            if target is not None:
                row += f"   (target <= {target:.2f}: {'met' if ratio <= target else 'NOT met'})"
            if against != "reference GPT":
                row += f"  vs {against}"
        print(row)
    return 0


def paired_ratio(times: list[float], reference: list[float]) -> float:
    """median_i times[i] / reference[i]: round i ran both within a second or two, so a slow
    spell of the machine (another process, a frequency change) cancels out of each ratio."""
    return statistics.median(t / r for t, r in zip(times, reference))
