"""python -m minitron.bench scaling: weak and strong scaling on CPU processes, measured and predicted.

Four sweeps over 1, 2, 4 and 8 gloo ranks, every step a TrainingRun (train/engine.py) step
(forward, backward, gradient reduction, AdamW), float32, one thread per rank:
  dp strong   the global batch fixed (8 sequences), split over dp ranks
  dp weak     8 sequences per rank: the global batch grows with the ranks
  tp strong   the model fixed (hidden 256), split over tp ranks (sequence parallelism on)
  tp weak     the work per rank about fixed: hidden 256, 384, 512, 768 for 1, 2, 4, 8 ranks
              (a layer's matmul FLOPs grow as h^2, so h ~ sqrt(ranks))
Two numbers per run, with two denominators:
Each run's time is the fastest of its timed steps over two passes through all runs, and each
machine constant the best of a few tries: on a shared machine the least disturbed measurement is the closest to the machine's own.
  scaling efficiency  model FLOP/s per rank over the one-rank run's (Shoeybi et al.'s definition:
                      strong scaling T1 / (n Tn), weak scaling the same per-rank throughput ratio)
  MFU                 model FLOP/s over the measured peak of the cores the ranks can use
                      (min(ranks, cores) x one core's float32 matmul FLOP/s, measured here)
The prediction is the planner's time model for this CPU (hardware.cpu: its measured matmul
peak, the fraction of it an fc1 of this model reaches (the CPU's efficiency curve, one point),
copy bandwidth, and gloo's all-reduce bandwidth and latency, bandwidths halved for
float32's 4-byte elements), times ranks/cores when more ranks than cores share the CPU.
Results go to a CSV with the date, machine and command (bench/results/scaling.csv).
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import os
import sys
import time

import torch

from ..estimate.flops import iteration_flops
from ..hardware import cpu
from ..estimate.time_model import Cluster, Parallel, step_time
from ..grid import ParallelConfig, build_grid
from ..config import ModelConfig
from ..runtime import comm
from ..runtime.launch import launch
from ..train.engine import TrainingRun
from ..verify import make_batch
from .overhead import machine

BASE = dict(vocab_size=2048, seq_len=128, n_layers=2, n_heads=8)
WEAK_TP_HIDDEN = {1: 256, 2: 384, 4: 512, 8: 768}
RANKS = (1, 2, 4, 8)
PER_RANK_BATCH = 8
FIELDS = ["sweep", "ranks", "hidden", "global_batch", "seconds", "model_flops", "efficiency", "mfu",
          "predicted_seconds", "predicted_efficiency", "date", "machine", "command"]


def sweeps(ranks=RANKS):
    """(sweep, ranks, hidden, global batch, ParallelConfig) of every run."""
    for n in ranks:
        yield "dp strong", n, 256, PER_RANK_BATCH, ParallelConfig(dp=n)
        yield "dp weak", n, 256, PER_RANK_BATCH * n, ParallelConfig(dp=n)
        yield "tp strong", n, 256, PER_RANK_BATCH, ParallelConfig(tp=n, sequence_parallel=n > 1)
        yield "tp weak", n, WEAK_TP_HIDDEN[n], PER_RANK_BATCH, ParallelConfig(tp=n, sequence_parallel=n > 1)


def _timed_steps(cfg: ModelConfig, pcfg: ParallelConfig, batch: int, steps: int) -> float:
    torch.set_num_threads(1)
    run = TrainingRun(cfg, pcfg, zero_stage=0, lr=1e-4)
    tokens, targets = make_batch(0, 0, batch, cfg.seq_len, cfg.vocab_size)
    run.step(tokens, targets, 0)                         # warm-up
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        run.step(tokens, targets, i + 1)
        times.append(time.perf_counter() - t0)
    return min(times)        # a shared machine: the fastest step is the least disturbed one


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _gloo_link(nbytes: int = 4 << 20, repeats: int = 5) -> tuple[float, float]:
    """(all-reduce bus bandwidth bytes/s, latency s) between two ranks."""
    big, small = torch.ones(nbytes // 4), torch.ones(1)
    grid_group = build_grid(ParallelConfig(dp=2)).dp
    out = []
    for t in (big, small):
        comm.all_reduce(t, grid_group)
        out.append(min(_seconds(lambda: comm.all_reduce(t, grid_group)) for _ in range(repeats)))
    latency = out[1]
    return nbytes / max(out[0] - latency, 1e-9), latency


def measure_machine() -> dict:
    """One core's float32 matmul FLOP/s, a copy's bandwidth, gloo's all-reduce (2 ranks)."""
    torch.set_num_threads(1)
    a = torch.randn(512, 512)
    torch.mm(a, a)
    peak = 2 * 512**3 / min(_seconds(lambda: torch.mm(a, a)) for _ in range(20))
    x, w = torch.randn(PER_RANK_BATCH * BASE["seq_len"], 256), torch.randn(256, 1024)  # an fc1
    shaped = 2 * x.shape[0] * 256 * 1024 / min(_seconds(lambda: torch.mm(x, w)) for _ in range(20))
    x = torch.ones(8 << 20)
    y = torch.empty_like(x)
    y.copy_(x)
    mem_bw = 2 * x.numel() * 4 / min(_seconds(lambda: y.copy_(x)) for _ in range(5))  # read + write
    link_bw, latency = launch(_gloo_link, world_size=2, backend="gloo")[0]
    return {"peak": peak, "matmul_eff": min(1.0, shaped / peak), "mem_bw": mem_bw, "link_bw": link_bw, "latency": latency,
            "cores": os.cpu_count() or 1}


def cpu_cluster(m: dict) -> Cluster:
    """This CPU for the time model (bandwidths halved: float32 moves twice bf16's bytes)."""
    g = cpu(m["peak"], m["mem_bw"] / 2, m["link_bw"] / 2, m["latency"])
    return Cluster(dataclasses.replace(g, matmul_eff=m["matmul_eff"]), m["cores"])


def model(hidden: int) -> ModelConfig:
    return ModelConfig(hidden=hidden, **BASE)


def predict(sweep: str, n: int, hidden: int, batch: int, m: dict) -> float:
    dim = sweep.split()[0]
    par = Parallel(tp=n if dim == "tp" else 1, dp=n if dim == "dp" else 1, zero=0,
                   sp=dim == "tp" and n > 1, micro_batch=batch // (n if dim == "dp" else 1))
    seconds = step_time(model(hidden), par, cpu_cluster(m), batch, software="minitron").seconds
    return seconds * max(1.0, n / m["cores"])          # more ranks than cores: they take turns


def run(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minitron.bench scaling", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3, help="timed steps per run (after one warm-up)")
    p.add_argument("--passes", type=int, default=2, help="passes over all runs; each run keeps its fastest")
    p.add_argument("--ranks", default="1,2,4,8", help="comma-separated rank counts, from 1")
    p.add_argument("--out", default="bench/results/scaling.csv")
    args = p.parse_args(argv)
    try:
        ranks = tuple(int(r) for r in args.ranks.split(","))
        if ranks[0] != 1 or any(r not in RANKS for r in ranks):
            raise ValueError
    except ValueError:
        print(f"error: --ranks {args.ranks}: give rank counts from 1, 2, 4, 8 starting at 1, "
              "e.g. --ranks 1,2,4,8", file=sys.stderr)
        return 2
    for flag, value in (("steps", args.steps), ("passes", args.passes)):
        if value < 1:
            print(f"error: --{flag} {value}: must be at least 1, e.g. --{flag} 2", file=sys.stderr)
            return 2
    m = measure_machine()
    print(f"machine: {machine()}\nmeasured: one core {m['peak'] / 1e9:.1f} GFLOP/s float32 matmul "
          f"(an fc1 of this model: {m['matmul_eff']:.0%} of it), "
          f"copy {m['mem_bw'] / 1e9:.1f} GB/s, gloo all-reduce {m['link_bw'] / 1e9:.2f} GB/s, "
          f"latency {m['latency'] * 1e6:.0f} us, {m['cores']} cores")
    rows, base = [], {}
    command = "python -m minitron.bench scaling " + " ".join(argv if argv is not None else sys.argv[2:])
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    measured = {}        # at one rank the four sweeps run the same configuration: measured once
    for _ in range(args.passes):                       # whole passes: a busy spell hits one pass
        for sweep, n, hidden, batch, pcfg in sweeps(ranks):
            key = (hidden, batch, pcfg)
            seconds = launch(_timed_steps, model(hidden), pcfg, batch, args.steps, world_size=n,
                             backend="gloo")[0]
            measured[key] = min(seconds, measured.get(key, seconds))
    for sweep, n, hidden, batch, pcfg in sweeps(ranks):
        cfg = model(hidden)
        seconds = measured[(hidden, batch, pcfg)]
        flops = iteration_flops(cfg, batch, cfg.seq_len, "none")
        per_rank = flops / seconds / n
        predicted = predict(sweep, n, hidden, batch, m)
        base.setdefault(sweep, (per_rank, flops / predicted))
        rows.append({"sweep": sweep, "ranks": n, "hidden": hidden, "global_batch": batch,
                     "seconds": f"{seconds:.4f}", "model_flops": f"{flops:.4g}",
                     "efficiency": f"{per_rank / base[sweep][0]:.3f}",
                     "mfu": f"{flops / seconds / (min(n, m['cores']) * m['peak']):.3f}",
                     "predicted_seconds": f"{predicted:.4f}",
                     "predicted_efficiency": f"{flops / predicted / n / base[sweep][1]:.3f}",
                     "date": date, "machine": machine(), "command": command})
        r = rows[-1]
        print(f"{sweep:<10} ranks {n}  {seconds:8.3f} s (predicted {predicted:7.3f})  efficiency "
              f"{r['efficiency']} (predicted {r['predicted_efficiency']})  MFU {r['mfu']}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {args.out}")
    return 0
