"""python -m minitron.bench overlap: how much of data parallelism's gradient all-reduce hides
behind backward, measured at dp=2 on the CPU (gloo); with --tp 2, beside it, how much of
sequence parallelism's all-gather / reduce-scatter the chunked ring hides behind the GEMMs
(tp_overlap.py).

Two ranks hold the same GPT (the overhead benchmark's) under DataParallel and train on their
halves of one batch. The gradient buffer is cut into `--buckets` buckets; the backward hook that
completes a bucket starts its all-reduce asynchronously (data_parallel/ddp.py) and backward
carries on with the earlier layers. One step's measured timeline, per rank: backward from its
start to its end (perf_counter, one clock for both processes), and each bucket's all-reduce
from its start to its finish (DataParallel.comm_events(): the finish is stamped by gloo's own
thread, through the work's future, when the collective completes). From it:

  hidden     the share of all-reduce time that lies inside backward: the headline (aim >= 80%)
  exposed    how long finish_grad_sync still waited once backward had ended
  alone      the same all-reduces one at a time, with nothing else running: what they cost
  slowdown   backward with the all-reduces beside it, over backward without them (no_sync)

Every rank measures `--repeats` steps after a warm-up step; the step with the median hidden
share (over both ranks) is drawn and its figures printed, with the range over all steps; the
alone and slowdown figures are medians of their own measurements, taken between those steps.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from ..runtime import comm
from ..grid import ParallelConfig, build_grid
from ..runtime.launch import launch
from ..config import ModelConfig
from ..model.parallel import ParallelGPT
from ..model.reference import GPT
from ..verify import make_batch
from . import intervals

AIM = 0.80


def _step(model, engine, tokens, targets, world, sync: bool) -> dict:
    """One forward and backward (both ranks start backward together); the measured timeline."""
    engine.zero_grad()
    model.rng.reset(0)
    _, loss = model(tokens, targets)
    comm.barrier(world)
    quiet = contextlib.nullcontext() if sync else engine.no_sync()
    with quiet:
        b0 = time.perf_counter()
        loss.backward()
        b1 = time.perf_counter()
    if not sync:
        return {"backward": (b0, b1)}
    engine.finish_grad_sync()
    done = time.perf_counter()
    comm_ = [(e.stage, e.start, e.end) for e in engine.comm_events()]
    return {"backward": (b0, b1), "done": done, "comm": comm_}


def _alone(sizes: list[int], group, world) -> list[float]:
    """Each bucket's all-reduce by itself, both ranks ready (a barrier first), blocking."""
    out = []
    for n in sizes:
        t = torch.randn(n)
        comm.barrier(world)
        t0 = time.perf_counter()
        comm.all_reduce(t, group)
        out.append(time.perf_counter() - t0)
    return out


def _overlap_rank(cfg: ModelConfig, batch: int, buckets: int, repeats: int) -> dict:
    from ..data_parallel import DataParallel
    from ..train.step import replica_rows

    grid = build_grid(ParallelConfig(dp=2))
    world = comm.Group("world", range(grid.world_size))
    model = ParallelGPT.from_reference(GPT(cfg, seed=0), grid)
    numel = sum(p.numel() for p in model.parameters())
    engine = DataParallel(model, grid, bucket_numel=-(-numel // buckets))
    engine.exact_timeline = True      # the finish stamped by gloo's thread, not polled (ddp.py)
    tokens, targets = make_batch(0, 0, batch, cfg.seq_len, cfg.vocab_size)
    rows = replica_rows(batch, grid)
    tokens, targets = tokens[rows], targets[rows]
    sizes = [b.numel for gb in engine.buffers for b in gb.layout.buckets]
    _step(model, engine, tokens, targets, world, sync=True)          # warm-up: gloo's pairs, allocator
    steps, quiet, alone = [], [], []
    for _ in range(repeats):      # alternate, so both kinds of step see the same machine
        steps.append(_step(model, engine, tokens, targets, world, sync=True))
        quiet.append(_step(model, engine, tokens, targets, world, sync=False))
        alone.append(_alone(sizes, grid.dense_dp, world))
    return {"steps": steps, "quiet": quiet, "alone": alone, "sizes": sizes,
            "threads": torch.get_num_threads()}


def summarize(step: dict) -> dict:
    """One step's figures, in seconds (hidden as a share)."""
    b0, b1 = step["backward"]
    total = sum(e - s for _, s, e in step["comm"])
    inside = sum(intervals.inside(s, e, [(b0, b1)]) for _, s, e in step["comm"])
    return {"backward": b1 - b0, "comm": total, "inside": inside,
            "hidden": inside / total if total else 0.0, "exposed": step["done"] - b1}


def timeline(step: dict, width: int = 56) -> list[str]:
    """Backward and each bucket's all-reduce as bars on one time axis (ms from backward's start)."""
    b0, b1 = step["backward"]
    t_end = max([step["done"]] + [e for _, _, e in step["comm"]])
    scale = width / (t_end - b0)

    def bar(label: str, s: float, e: float) -> str:
        lo, hi = int((s - b0) * scale), max(int((s - b0) * scale) + 1, int((e - b0) * scale))
        return (f"  {label:<20}|{' ' * lo}{'#' * (hi - lo)}{' ' * (width - hi)}| "
                f"{1e3 * (s - b0):7.1f} -{1e3 * (e - b0):7.1f} ms")
    lines = [bar("backward", b0, b1)]
    lines += [bar(f"bucket {b} all-reduce", s, e) for b, s, e in step["comm"]]
    lines.append(bar("waiting after bwd", b1, step["done"]))
    return lines


def run(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minitron.bench overlap")
    p.add_argument("--buckets", type=int, default=4, help="buckets the gradient buffer is cut into")
    p.add_argument("--batch", type=int, default=8, help="global batch (each rank takes half)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tp", type=int, default=1, choices=(1, 2),
                   help="2: also the tensor-parallel overlap (SP's comm behind the GEMMs, tp=2)")
    p.add_argument("--plot", default=None, help="with --tp 2: draw its timeline into this PNG")
    args = p.parse_args(argv)
    if args.buckets < 1 or args.repeats < 1 or args.batch < 2 or args.batch % 2:
        p.error("--buckets and --repeats must be >= 1, --batch even (two ranks share it)")
    if args.plot and args.tp != 2:
        p.error(f"--plot {args.plot} draws the tensor-parallel timeline: add --tp 2")
    dp_hidden = _data_parallel(args)
    if args.tp == 2:
        from . import tp_overlap
        print("\ntensor parallel, SP's all-gather / reduce-scatter chunked behind the GEMMs "
              "(--tp-comm-overlap):")
        tp = tp_overlap.run(tp_overlap.SHAPE, args.repeats, plot_to=args.plot)
        print(f"\nhidden, side by side: data parallel {100 * dp_hidden:.0f}% of the gradient "
              f"all-reduces behind backward (aim {100 * AIM:.0f}%); tensor parallel "
              f"{100 * tp['hidden']:.0f}% of the SP messages behind the GEMMs (aim "
              f"{100 * tp_overlap.AIM:.0f}%)")
    return 0


def _data_parallel(args) -> float:
    """The data-parallel measurement, printed; returns its median step's hidden share."""
    from .overhead import OVERHEAD_CONFIG, machine
    cfg = OVERHEAD_CONFIG
    ranks = launch(_overlap_rank, cfg, args.batch, args.buckets, args.repeats, world_size=2,
                   backend="gloo")
    # every measured step of both ranks; the one with the median hidden share speaks for all
    steps = sorted(((summarize(s), r, s) for r, rank in enumerate(ranks) for s in rank["steps"]),
                   key=lambda x: x[0]["hidden"])
    fig, typical_rank, typical = steps[len(steps) // 2]
    shares = [f["hidden"] for f, _, _ in steps]
    with_comm = statistics.median(f["backward"] for f, _, _ in steps)
    without = statistics.median(s["backward"][1] - s["backward"][0] for r in ranks for s in r["quiet"])
    sizes = ranks[0]["sizes"]
    alone = [statistics.median(a[b] for r in ranks for a in r["alone"]) for b in range(len(sizes))]

    print(f"machine: {machine()}")
    print(f"config:  {cfg}")
    print(f"run:     dp=2 on gloo, {ranks[0]['threads']} compute thread(s) per rank, batch "
          f"{args.batch} x {cfg.seq_len} (half per rank), {len(sizes)} buckets of "
          f"{', '.join(f'{4 * n / 2**20:.1f}' for n in sizes)} MiB, {args.repeats} steps after a warm-up")
    print(f"timeline of the median step (by hidden share, of {len(steps)}: {args.repeats} per "
          f"rank), rank {typical_rank}:")
    print("\n".join(timeline(typical)))
    verdict = "met" if fig["hidden"] >= AIM else "NOT met"
    by_cost = 1 - fig["exposed"] / sum(alone) if sum(alone) else 0.0
    print(f"all-reduce time hidden behind backward  {100 * fig['hidden']:5.1f}%   (aim >= "
          f"{100 * AIM:.0f}%: {verdict}; the steps ranged {100 * shares[0]:.0f}-{100 * shares[-1]:.0f}%)")
    print(f"  timeline: {1e3 * fig['comm']:.1f} ms of all-reduce in flight, {1e3 * fig['inside']:.1f} "
          "ms of it while backward ran")
    print(f"  by cost:  the same all-reduces alone take {1e3 * sum(alone):.1f} ms; finish_grad_sync "
          f"still waited {1e3 * fig['exposed']:.1f} ms after backward: {100 * by_cost:.0f}% of "
          "that cost hidden")
    print(f"backward {1e3 * with_comm:.1f} ms with the all-reduces beside it, {1e3 * without:.1f} ms "
          f"without (no_sync): x{with_comm / without:.2f}")
    print("what limits it on gloo:")
    print(f"  - the last bucket is complete only when backward ends, so its all-reduce is always "
          f"exposed: {1e3 * alone[-1]:.1f} ms alone, {100 * alone[-1] / sum(alone):.0f}% of the "
          "cost (smaller buckets shrink it, but each collective pays gloo's latency)")
    print(f"  - gloo runs each collective on a CPU thread of its own, copying and summing in memory: "
          f"it needs a core, and the two ranks' backward already keep the {_cores()} core(s) busy, "
          f"so the all-reduces stretch ({1e3 * fig['comm']:.1f} ms in flight against "
          f"{1e3 * sum(alone):.1f} ms alone) and take time from backward; NCCL on GPUs does this "
          "work on the network and copy engines, beside the compute kernels")
    return fig["hidden"]


def _cores() -> int:
    import os
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
