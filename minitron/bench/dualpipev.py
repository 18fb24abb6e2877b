"""python -m minitron.bench dualpipev --pp 2 --experts 4 --ep 2: how much of the MoE all-to-all
DualPipeV's overlapped (F, BW) pairs hide, measured on CPU ranks.

pp x ep ranks run one MoE GPT (every layer's MLP 4 experts, top 2) under the DualPipeV schedule,
once with each pair's halves overlapped (pipeline/pairs.py: one half computes while the other's
all-to-all is in flight) and once with them one after the other, alternating step by step so
that both see the same machine. pairs.recording() stamps every half's compute segments and every
all-to-all it started, with when it finished (perf_counter: one clock for every process). From
that measured timeline:

  hidden   the share of all-to-all time that lies inside the *other* half's compute (a half never
           computes during its own all-to-all, so a run without overlap hides exactly 0)
  exposed  the all-to-all time outside it: the rank stood waiting for bytes (or for its peer)
  step     the step's wall time (the first rank's start to the last rank's end), median over the
           repeats; `ratio` is the median of each round's overlap / no-overlap step
  simulated  simulate(..., overlap=True and False) with Costs fitted to the measured run without
           overlap (each kind's median compute, the median all-to-all per action): the
           simulator's prediction of the same ratio

On gloo an all-to-all's time is mostly the wait for the slower ep rank to arrive, and gloo's
threads need a core that the ranks' compute already holds: on a loaded 2-core machine the
shares are low and noisy. NCCL on GPUs moves the bytes on their own engines.

The figures of a timeline are in dualpipev_timeline.py, the drawing and the CSV in
dualpipev_output.py.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from ..config import ModelConfig
from ..grid import ParallelConfig, build_grid
from ..model.stages import PipelineGPT
from ..pipeline import make_schedule, pairs
from ..pipeline.executor import run_schedule
from ..pipeline.simulate import simulate
from ..runtime import comm
from ..runtime.launch import launch
from .dualpipev_timeline import _ms, fitted_costs, hidden_share, simulated_hidden

SHAPE = dict(vocab_size=64, seq_len=16, hidden=64, n_layers=4, n_heads=4, dropout=0.0, topk=2)


# ---- the measurement ------------------------------------------------------------------------
def _rank(cfg: ModelConfig, pcfg: ParallelConfig, microbatches: int, rows: int, repeats: int):
    torch.set_num_threads(1)
    grid = build_grid(pcfg)
    world = comm.Group("world", range(grid.world_size))
    schedule = make_schedule("dualpipev", pcfg.pp, microbatches)
    model = PipelineGPT(cfg, grid, schedule.stage_rank, seed=0).train()
    gen = torch.Generator().manual_seed(grid.ep.rank)          # each ep rank its own rows
    data = torch.randint(0, cfg.vocab_size, (rows * microbatches, cfg.seq_len + 1), generator=gen)

    def step(overlap: bool, seed: int) -> dict:
        model.zero_grad(set_to_none=True)
        model.rng.reset(seed)
        comm.barrier(world)
        with pairs.recording() as segments:
            t0 = time.perf_counter()
            result = run_schedule(schedule, model, data[:, :-1], data[:, 1:], keep_outputs=False,
                                  overlap=overlap)
            t1 = time.perf_counter()
        return {"overlap": overlap, "span": (t0, t1), "segments": segments,
                "events": result.events}

    step(True, 0), step(False, 0)              # warm-up: gloo's pairs, the allocator, threads
    steps = []
    for i in range(repeats):                   # alternate which goes first, round by round
        for overlap in ((True, False) if i % 2 == 0 else (False, True)):
            steps.append({**step(overlap, i + 1), "round": i})
    return {"pp": grid.pp.rank, "ep": grid.ep.rank, "steps": steps}


def measure(pp: int, ep: int, experts: int, microbatches: int, rows: int, repeats: int,
            shape: dict = SHAPE) -> dict:
    """Run both ways on pp x ep ranks; every step's figures, over all ranks."""
    cfg = ModelConfig(**shape, n_experts=experts)
    pcfg = ParallelConfig(pp=pp, ep=ep, virtual_pp=2)
    ranks = launch(_rank, cfg, pcfg, microbatches, rows, repeats, world_size=pp * ep,
                   backend="gloo")
    steps = []
    for k in range(len(ranks[0]["steps"])):
        at = [{**r["steps"][k], "pp": r["pp"], "ep": r["ep"]} for r in ranks]
        figures = [hidden_share(s["segments"]) for s in at]
        comm_s, inside = sum(f["comm"] for f in figures), sum(f["inside"] for f in figures)
        steps.append({"overlap": at[0]["overlap"], "round": at[0]["round"],
                      "step": max(s["span"][1] for s in at) - min(s["span"][0] for s in at),
                      "comm": comm_s, "inside": inside, "hidden": inside / comm_s if comm_s else 0.0,
                      "ranks": at})
    return {"steps": steps, "schedule": make_schedule("dualpipev", pp, microbatches),
            "config": cfg, "rows": rows}


def median_step(steps: list[dict], overlap: bool) -> dict:
    """The step (overlapped or not) with the median step time."""
    mine = sorted((s for s in steps if s["overlap"] == overlap), key=lambda s: s["step"])
    return mine[len(mine) // 2]


# ---- the report -----------------------------------------------------------------------------
def summarize(measured: dict) -> dict:
    """The headline figures: medians over the rounds, and the simulator's with fitted costs."""
    steps, schedule = measured["steps"], measured["schedule"]
    ours, plain = median_step(steps, True), median_step(steps, False)
    rounds = sorted({s["round"] for s in steps})
    time_of = {(s["round"], s["overlap"]): s["step"] for s in steps}
    ratios = sorted(time_of[(r, True)] / time_of[(r, False)] for r in rounds)
    costs = fitted_costs(_ms(plain["ranks"][0]["segments"]))
    apart, together = simulate(schedule, costs), simulate(schedule, costs, overlap=True)
    return {"hidden": statistics.median(s["hidden"] for s in steps if s["overlap"]),
            "hidden_plain": statistics.median(s["hidden"] for s in steps if not s["overlap"]),
            "hidden_range": (min(s["hidden"] for s in steps if s["overlap"]),
                             max(s["hidden"] for s in steps if s["overlap"])),
            "step": ours["step"], "step_plain": plain["step"], "ratio": statistics.median(ratios),
            "ratio_range": (ratios[0], ratios[-1]),
            "costs": costs, "simulated": together, "simulated_apart": apart,
            "simulated_ratio": float(together.makespan / apart.makespan),
            "simulated_hidden": simulated_hidden(schedule, costs), "ours": ours, "plain": plain}


def report(pp: int, ep: int, experts: int, microbatches: int, rows: int, repeats: int,
           plot_to: str | None = None, csv_to: str | None = None, shape: dict = SHAPE) -> dict:
    measured = measure(pp, ep, experts, microbatches, rows, repeats, shape)
    summary = summarize(measured)
    cfg, pairs_per_rank = measured["config"], {r: len(p) for r, p in
                                               measured["schedule"].overlapped.items()}
    low, high = summary["hidden_range"]
    c = summary["costs"]
    print(f"run:     DualPipeV pp={pp} x ep={ep} on gloo ({pp * ep} ranks, 1 thread each), "
          f"{microbatches} micro-batches of {rows} x {cfg.seq_len} tokens per ep rank; "
          f"{cfg.n_layers} layers of {experts} experts (top {cfg.topk}), hidden {cfg.hidden}; "
          f"overlapped (F, BW) pairs per rank {pairs_per_rank}; {repeats} rounds of both after a warm-up")
    print(f"all-to-all time hidden behind the other half's compute  {100 * summary['hidden']:5.1f}% "
          f"(median; the rounds ranged {100 * low:.0f}-{100 * high:.0f}%); without overlap "
          f"{100 * summary['hidden_plain']:.1f}%")
    print(f"step {1e3 * summary['step']:.1f} ms with the overlap, {1e3 * summary['step_plain']:.1f} ms "
          f"without (medians): ratio overlap / no overlap {summary['ratio']:.3f} (median of the rounds; they ranged "
          f"{summary['ratio_range'][0]:.2f}-{summary['ratio_range'][1]:.2f})")
    print(f"prediction (simulator, costs fitted to the run without overlap: F {c.F:.2f}, B {c.B:.2f}, "
          f"W {c.W:.2f}, all-to-all {c.comm:.2f} ms per stage): ratio {summary['simulated_ratio']:.3f}, "
          f"{100 * summary['simulated_hidden']:.0f}% hidden")
    cores, load = len(os.sched_getaffinity(0)), os.getloadavg()[0]
    print(f"what limits it here: {pp * ep} ranks and their gloo threads share {cores} core(s) "
          f"(1-min load average {load:.1f}); a half hides an all-to-all only if a core is free to "
          "compute it while gloo moves the bytes, and most of an all-to-all's time here is the wait "
          "for the other ep rank to arrive; on GPUs NCCL moves the bytes beside the compute kernels")
    command = (f"python -m minitron.bench dualpipev --pp {pp} --experts {experts} --ep {ep} "
               f"--microbatches {microbatches} --rows {rows} --repeats {repeats}")
    from .dualpipev_output import plot, write_csv
    if csv_to:
        write_csv(csv_to, measured, summary, command + f" --csv {csv_to}")
        print(f"every step in {csv_to}")
    if plot_to:
        plot(summary, pp, plot_to)
        print(f"timelines drawn in {plot_to}")
    return summary


def run(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minitron.bench dualpipev")
    p.add_argument("--pp", type=int, default=2, help="pipeline ranks (2 stages each, a V)")
    p.add_argument("--ep", type=int, default=2, help="expert-parallel ranks inside each stage")
    p.add_argument("--experts", type=int, default=4, help="experts per MoE layer (top 2)")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--rows", type=int, default=2, help="sequences per micro-batch and ep rank")
    p.add_argument("--repeats", type=int, default=5, help="rounds of both kinds of step")
    p.add_argument("--plot", default=None, help="draw the timelines into this PNG")
    p.add_argument("--csv", default=None, help="write every step's figures into this CSV")
    args = p.parse_args(argv)
    if args.pp < 2 or args.ep < 2:
        p.error(f"--pp {args.pp} --ep {args.ep}: both must be >= 2 (a pipeline, and an "
                "all-to-all between ep ranks to hide)")
    if args.experts < 2 or args.experts % args.ep:
        p.error(f"--experts {args.experts}: at least 2 (top 2) and a multiple of --ep {args.ep}")
    if args.microbatches < 2 * args.pp or args.rows < 1 or args.repeats < 1:
        p.error(f"--microbatches must be >= 2 * pp = {2 * args.pp} (DualPipeV's steady state), "
                "--rows and --repeats >= 1")
    report(args.pp, args.ep, args.experts, args.microbatches, args.rows, args.repeats,
           args.plot, args.csv)
    return 0
