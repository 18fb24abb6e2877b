"""python -m minitron.bench overlap --tp 2: how much of sequence parallelism's communication
the chunked ring (tensor_parallel/overlap.py) hides behind the GEMMs, measured on CPU ranks.

Two ranks run one Transformer MLP under SP, Column(h -> ffn) -> GeLU -> Row(ffn -> h), forward
and backward: four rings (forward: all-gather x behind fc1's GEMM, reduce-scatter behind fc2's;
backward: all-gather dL/dy behind fc2's dL/dx and dL/dW GEMMs, reduce-scatter behind fc1's),
each of tp GEMM chunks and tp-1 messages of one [b, s/tp, h] chunk. overlap.recording() stamps
every GEMM chunk and every message (perf_counter: one clock for both processes). A message's
bar starts when it is posted and ends when its wait returns: gloo's send/recv works carry no
completion time, so a message that arrived during its GEMM ends with that GEMM. From it:

  hidden   the share of message time that lies inside a GEMM chunk (the headline, aim >= 60%)
  exposed  the message time outside every GEMM: how long the ring stood waiting
  alone    the same messages one at a time with nothing else running: what they cost
  speed    the step with the overlap against plain SP (blocking all-gather, reduce-scatter)

Every rank measures `--repeats` steps after a warm-up; the step with the median hidden share
(over both ranks) is drawn, with the range over all steps.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from ..grid import ParallelConfig, build_grid
from ..runtime import comm
from ..runtime.comm import P2P
from ..runtime.launch import launch
from ..tensor_parallel import overlap
from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from . import intervals

AIM = 0.60
SHAPE = {"batch": 4, "seq": 256, "hidden": 512, "ffn": 2048}   # a message: 1 MiB; a GEMM chunk: 0.5 GFLOP


def _mlp(shape: dict, group, overlapped: bool):
    torch.manual_seed(0)       # the same full weights on every rank; each keeps its shard
    h, ffn = shape["hidden"], shape["ffn"]
    fc1 = ColumnParallelLinear(h, ffn, group, sequence_parallel=True, comm_overlap=overlapped)
    fc2 = RowParallelLinear(ffn, h, group, sequence_parallel=True, comm_overlap=overlapped)
    return fc1, fc2


def _step(fc1, fc2, x, world) -> tuple[float, float]:
    """One forward and backward of the MLP, both ranks starting together."""
    x = x.detach().requires_grad_()
    comm.barrier(world)
    t0 = time.perf_counter()
    y = fc2(F.gelu(fc1(x)))
    y.backward(torch.ones_like(y))
    return t0, time.perf_counter()


def _alone(chunk: torch.Tensor, group, world, count: int) -> list[float]:
    """`count` ring messages of one chunk, each by itself (a barrier first), blocking."""
    n, r = group.size, group.rank
    out = []
    for _ in range(count):
        got = torch.empty_like(chunk)
        comm.barrier(world)
        t0 = time.perf_counter()
        comm.exchange([P2P("send", chunk, (r + 1) % n), P2P("recv", got, (r - 1) % n)], group)
        out.append(time.perf_counter() - t0)
    return out


def _rank(shape: dict, repeats: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    grid = build_grid(ParallelConfig(tp=2, sequence_parallel=True))
    world = comm.Group("world", range(grid.world_size))
    b, s, h = shape["batch"], shape["seq"] // grid.tp.size, shape["hidden"]
    x = torch.randn(b, s, h)
    ours, plain = _mlp(shape, grid.tp, True), _mlp(shape, grid.tp, False)
    _step(*ours, x, world), _step(*plain, x, world)       # warm-up: gloo's pairs, the allocator
    steps, plain_times, alone = [], [], []
    for _ in range(repeats):          # alternate, so both kinds of step see the same machine
        with overlap.recording() as events:
            span = _step(*ours, x, world)
        steps.append({"span": span, "events": events})
        t0, t1 = _step(*plain, x, world)
        plain_times.append(t1 - t0)
        alone.append(_alone(x, grid.tp, world, sum(k == "comm" for k, *_ in events)))
    return {"steps": steps, "plain": plain_times, "alone": alone, "threads": threads}


def summarize(step: dict) -> dict:
    """One step's figures, in seconds (hidden as a share)."""
    gemms = [(s, e) for kind, _, s, e in step["events"] if kind == "gemm"]
    msgs = [(s, e) for kind, _, s, e in step["events"] if kind == "comm"]
    total = sum(e - s for s, e in msgs)
    inside = sum(intervals.inside(s, e, gemms) for s, e in msgs)   # GEMM chunks never overlap
    t0, t1 = step["span"]
    return {"step": t1 - t0, "comm": total, "inside": inside, "exposed": total - inside,
            "gemm": sum(e - s for s, e in gemms), "hidden": inside / total if total else 0.0}


def timeline(step: dict, width: int = 56) -> list[str]:
    """Every GEMM chunk and message as a bar on one time axis (ms from the step's start)."""
    t0, t1 = step["span"]
    scale = width / (t1 - t0)

    def bar(label: str, s: float, e: float) -> str:
        lo = min(width - 1, int((s - t0) * scale))
        hi = min(width, max(lo + 1, int((e - t0) * scale)))
        return (f"  {label:<34}|{' ' * lo}{'#' * (hi - lo)}{' ' * (width - hi)}| "
                f"{1e3 * (s - t0):7.1f} -{1e3 * (e - t0):7.1f} ms")
    return [bar(("GEMM " if kind == "gemm" else "") + label, s, e)
            for kind, label, s, e in step["events"]]


def plot(step: dict, ax=None, title: str = ""):
    """The timeline drawn: GEMM chunks on one row, messages on the row below (matplotlib)."""
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 2.2))
    t0 = step["span"][0]
    colors = {"all-gather": "tab:blue", "reduce-scatter": "tab:orange"}
    for kind, label, s, e in step["events"]:
        row = 1 if kind == "gemm" else 0
        color = colors["all-gather" if label.startswith("all-gather") else "reduce-scatter"]
        ax.broken_barh([(1e3 * (s - t0), 1e3 * (e - s))], (row - 0.35, 0.7), facecolors=color,
                       edgecolors="black", linewidth=0.5, alpha=1.0 if kind == "gemm" else 0.55)
    ax.set_yticks([0, 1], ["message", "GEMM chunk"])
    ax.set_xlabel("ms from the step's start (blue: all-gather rings, orange: reduce-scatter rings)")
    ax.set_ylim(-0.7, 1.7)
    if title:
        ax.set_title(title, fontsize=9)
    return ax


def measure(shape: dict, repeats: int, threads: int = 1) -> dict:
    """Both ranks' measured steps; `median` is the step with the median hidden share."""
    ranks = launch(_rank, shape, repeats, threads, world_size=2, backend="gloo")
    steps = sorted(((summarize(s), r, s) for r, rank in enumerate(ranks) for s in rank["steps"]),
                   key=lambda x: x[0]["hidden"])
    return {"ranks": ranks, "sorted": steps, "median": steps[len(steps) // 2]}


def run(shape: dict, repeats: int, threads: int = 1, plot_to: str | None = None) -> dict:
    """Measure on two ranks; print the median step's timeline and figures; return them."""
    measured = measure(shape, repeats, threads)
    ranks, steps = measured["ranks"], measured["sorted"]
    fig, typical_rank, typical = measured["median"]
    shares = [f["hidden"] for f, _, _ in steps]
    alone = statistics.median(sum(a) for r in ranks for a in r["alone"])
    ours = statistics.median(f["step"] for f, _, _ in steps)
    plain = statistics.median(t for r in ranks for t in r["plain"])
    b, s, h = shape["batch"], shape["seq"], shape["hidden"]
    chunk = b * (s // 2) * h * 4
    print(f"run:     tp=2 with SP on gloo, {threads} compute thread(s) per rank; one MLP "
          f"{h} -> {shape['ffn']} -> {h} on {b} x {s} tokens, forward and backward; messages of "
          f"{chunk / 2**20:.2f} MiB ([b, s/tp, h]); {repeats} steps after a warm-up")
    print(f"timeline of the median step (by hidden share, of {len(steps)}), rank {typical_rank}:")
    print("\n".join(timeline(typical)))
    verdict = "met" if fig["hidden"] >= AIM else "NOT met"
    print(f"TP communication hidden behind the GEMMs  {100 * fig['hidden']:5.1f}%   (aim >= "
          f"{100 * AIM:.0f}%: {verdict}; the steps ranged {100 * shares[0]:.0f}-{100 * shares[-1]:.0f}%)")
    print(f"  timeline: {1e3 * fig['comm']:.1f} ms of messages in flight, {1e3 * fig['inside']:.1f} ms "
          f"of it inside {1e3 * fig['gemm']:.1f} ms of GEMM chunks; {1e3 * fig['exposed']:.1f} ms exposed")
    by_cost = 1 - fig["exposed"] / alone if alone else 0.0
    print(f"  by cost:  the same messages alone take {1e3 * alone:.1f} ms: {100 * max(0.0, by_cost):.0f}% "
          "of that cost hidden")
    print(f"step {1e3 * ours:.1f} ms with the overlap, {1e3 * plain:.1f} ms plain SP (blocking "
          f"all-gather / reduce-scatter): x{plain / ours:.2f}")
    if plot_to:
        import matplotlib.pyplot as plt
        ax = plot(typical, title=f"tp=2, SP, --tp-comm-overlap: one MLP forward and backward on "
                                 f"rank {typical_rank}; {100 * fig['hidden']:.0f}% of message time "
                                 "inside a GEMM")
        ax.figure.savefig(plot_to, dpi=110, bbox_inches="tight")
        plt.close(ax.figure)
        print(f"timeline drawn in {plot_to}")
    return {"hidden": fig["hidden"], "range": (shares[0], shares[-1]), "by_cost": by_cost,
            "step": ours, "plain": plain}
