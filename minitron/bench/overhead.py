"""python -m minitron.bench overhead

overhead: what the parallel machinery costs when there is nothing to split. The reference GPT
and each parallel path at size one train on the same batch in the same process, one full step
each (forward, backward, gradient fix-ups, optimizer), in a rotating order so that all see the
same machine state, several repeats; the medians are compared:
  ParallelGPT, tp=1                 every mapping the identity, every collective skipped
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
Targets: parallel / reference <= 1.10 for ParallelGPT, <= 1.05 for the pipeline, data-
parallel and context-parallel paths (they add no arithmetic to ParallelGPT's). Both clocks are printed: wall time,
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

from ..grid import ParallelConfig, build_grid
from ..runtime.launch import launch
from ..model.config import ModelConfig
from ..model.parallel import ParallelGPT
from ..model.reference import GPT
from ..context_parallel import shard_sequence
from ..train.step import parallel_step
from ..verify import make_batch, reference_step

TARGET = 1.10            # ParallelGPT at tp=1
PATH_TARGET = 1.05       # the pipeline executor and the data-parallel engines on top of it
OVERHEAD_CONFIG = ModelConfig(vocab_size=2048, seq_len=128, hidden=256, n_layers=4, n_heads=8,
                              dropout=0.1)


def _adamw(model: torch.nn.Module):
    """torch's AdamW on `model`: a function that steps it and clears the gradients."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def _paths(cfg: ModelConfig, batch: int, grid) -> dict:
    """label -> (target, or None for the reference; one training step), all from one reference."""
    from ..data_parallel import wrap
    from ..data_parallel.step import forward_backward
    from ..pipeline import make_schedule
    from ..pipeline.executor import run_schedule
    from ..pipeline.partition import PipelineGPT

    ref = GPT(cfg, seed=0)
    tokens, targets = make_batch(0, 0, batch, cfg.seq_len, cfg.vocab_size)
    par = ParallelGPT.from_reference(ref, grid)
    pipe = PipelineGPT.from_reference(ref, grid)
    schedule = make_schedule("1f1b", 1, 1)
    ref_step, par_step, pipe_step = _adamw(ref), _adamw(par), _adamw(pipe)

    def reference():
        reference_step(ref, tokens, targets, 0)
        ref_step()

    def parallel():
        parallel_step(par, tokens, targets, 0)
        par_step()

    def pipeline():
        pipe.rng.reset(0)
        run_schedule(schedule, pipe, tokens, targets, keep_outputs=False)
        pipe_step()

    def data_parallel(stage: int):
        model = ParallelGPT.from_reference(ref, grid)
        engine, opt = wrap(model, grid, zero_stage=stage, lr=1e-4)

        def run():
            engine.zero_grad()
            forward_backward(model, engine, tokens, targets, step_seed=0)
            engine.finish_grad_sync()
            opt.step()
        return run

    def context_parallel(force_ring: bool):
        model = ParallelGPT.from_reference(ref, grid)
        model.ctx.context_parallel = force_ring   # True: the ring with one rank in it
        step = _adamw(model)
        cp = grid.cp

        def run():
            parallel_step(model, shard_sequence(tokens, cp.size, cp.rank),
                          shard_sequence(targets, cp.size, cp.rank), 0)
            step()
        return run

    moe_cfg = dataclasses.replace(cfg, n_experts=4, topk=2)
    moe_ref = GPT(moe_cfg, seed=0)
    moe_par = ParallelGPT.from_reference(moe_ref, grid)
    moe_ref_step, moe_par_step = _adamw(moe_ref), _adamw(moe_par)

    def moe_reference():
        reference_step(moe_ref, tokens, targets, 0)
        moe_ref_step()

    def moe_parallel():
        parallel_step(moe_par, tokens, targets, 0)
        moe_par_step()

    # label -> (target or None, step, the row its ratio is taken against or None)
    base = "reference GPT"
    return {base: (None, reference, None),
            "ParallelGPT, tp=1": (TARGET, parallel, base),
            "pipeline pp=1, 1f1b m=1": (PATH_TARGET, pipeline, base),
            "data parallel dp=1": (PATH_TARGET, data_parallel(0), base),
            "ZeRO-1 dp=1": (PATH_TARGET, data_parallel(1), base),
            "ZeRO-3 dp=1": (PATH_TARGET, data_parallel(3), base),
            "context parallel cp=1": (PATH_TARGET, context_parallel(False), base),
            "ring forced on at cp=1": (None, context_parallel(True), base),
            "MoE reference GPT": (None, moe_reference, None),
            "ParallelGPT MoE, ep=1": (PATH_TARGET, moe_parallel, "MoE reference GPT")}


def _overhead_rank(cfg: ModelConfig, batch: int, repeats: int, warmup: int) -> dict:
    paths = _paths(cfg, batch, build_grid(ParallelConfig(tp=1)))
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
