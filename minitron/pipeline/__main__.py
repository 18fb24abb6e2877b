"""python -m minitron.pipeline: a schedule's bubble and memory, simulated (and measured), drawn.

    python -m minitron.pipeline --schedule 1f1b --pp 4 --microbatches 8
    python -m minitron.pipeline --schedule interleaved --pp 4 --microbatches 8 --virtual 2 --plot t.png
    python -m minitron.pipeline --schedule zb-h1 --pp 2 --microbatches 4 --costs 1,1,1 --measure
    python -m minitron.pipeline --schedule dualpipev --pp 4 --microbatches 16 --comm 1 --overlap

Prints the simulated bubble fraction (idle share of pp x makespan, and the bubble in units of
the ideal time), the checker's peak activations per rank, and, with --measure, the bubble of
the same schedule run by the executor on real processes (a small GPT, two blocks per stage: see
measured_model). --comm adds an all-to-all of that time to every stage's F and B (a mixture of
experts' dispatch and combine); --overlap runs each overlapped pair of the schedule (DualPipeV's
F of one micro-batch with the BW of another) as one, hiding one's communication under the
other's compute (simulate.py). Bad input: one line on stderr, exit 2.
"""
from __future__ import annotations

import argparse
import os
import sys
from fractions import Fraction

from ..config import ModelConfig
from .check import check
from .schedules import SCHEDULES, make_schedule
from .simulate import Costs, simulate


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minitron.pipeline", description=__doc__.split("\n")[0])
    p.add_argument("--schedule", default="1f1b", help=f"one of {', '.join(SCHEDULES)} (default 1f1b)")
    p.add_argument("--pp", type=int, default=4, help="pipeline ranks (default 4)")
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per step (default 8)")
    p.add_argument("--virtual", type=int, default=None,
                   help="model chunks per rank (default: the schedule's own, 2 for interleaved, zb-v, dualpipev)")
    p.add_argument("--costs", default="1,1,1", help="F,B,W time of one stage's micro-batch (default 1,1,1)")
    p.add_argument("--latency", default="0", help="time of one message in flight (default 0)")
    p.add_argument("--comm", default="0", help="communication inside each stage's F and B, "
                   "e.g. the MoE all-to-all (default 0)")
    p.add_argument("--overlap", action="store_true",
                   help="run the schedule's overlapped (F, BW) pairs as one (DualPipeV)")
    p.add_argument("--measure", action="store_true", help="also run it on real processes and time it")
    p.add_argument("--plot", metavar="PNG", help="draw the timeline(s) to this file")
    return p


def parse_costs(costs: str, latency: str, comm: str = "0") -> Costs:
    """'1,2,1', '0.5' and '1' -> Costs(F=1, B=2, W=1, latency=1/2, comm=1), kept exact."""
    parts = costs.split(",")
    try:
        if len(parts) != 3:
            raise ValueError
        values = [Fraction(x.strip()) for x in parts + [latency, comm]]
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"--costs takes three numbers F,B,W such as 1,2,1, --latency and --comm "
                         f"one number each, got --costs {costs!r} --latency {latency!r} "
                         f"--comm {comm!r}") from None
    return Costs(*values)


def build(name: str, pp: int, microbatches: int, virtual: int | None):
    if virtual is None and name in SCHEDULES:
        return SCHEDULES[name](pp, microbatches)        # the schedule's default chunk count
    return make_schedule(name, pp, microbatches, 1 if virtual is None else virtual)


def describe(schedule, costs: Costs, timeline, report, overlap: bool = False) -> list[str]:
    """The printed summary of a schedule, its simulated timeline and its check report."""
    return [f"schedule {schedule.name}: pp={schedule.pp}, microbatches={schedule.microbatches}, "
            f"virtual={schedule.virtual}; costs F:B:W = {costs.F}:{costs.B}:{costs.W}, "
            f"latency {costs.latency}" + (f", comm {costs.comm}" if costs.comm else ""),
            f"simulated makespan: {timeline.makespan}" + (
                f" ({sum(map(len, schedule.overlapped.values()))} overlapped pairs, all ranks, "
                "each run as one)"
                if overlap else ""),
            f"simulated bubble fraction: {float(timeline.bubble_fraction):.3f} (idle share of "
            f"pp x makespan; bubble / ideal time: {float(timeline.bubble_ratio):.3f})",
            "peak activations per rank (micro-batches in flight, full-stage units): "
            + ", ".join(f"rank {r}: {float(p):.3g}" for r, p in sorted(report.peak_activations.items()))]


def measured_model(schedule) -> ModelConfig:
    """The GPT --measure runs: two blocks per stage, big enough that compute outweighs messages."""
    return ModelConfig(vocab_size=256, seq_len=64, hidden=256, n_heads=4,
                       n_layers=2 * schedule.pp * schedule.virtual)


def measure(schedule):
    from .measure import measure as run_and_time   # torch processes: only when asked for
    return run_and_time(schedule, measured_model(schedule))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        costs = parse_costs(args.costs, args.latency, args.comm)
        schedule = build(args.schedule, args.pp, args.microbatches, args.virtual)
        if args.plot and not os.path.isdir(os.path.dirname(os.path.abspath(args.plot))):
            raise ValueError(f"--plot {args.plot}: its folder does not exist; create it first")
        report = check(schedule)
        simulated = simulate(schedule, costs, overlap=args.overlap)
    except ValueError as e:          # ScheduleError is a ValueError too
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(describe(schedule, costs, simulated, report, args.overlap)))
    measured = None
    if args.measure:
        measured, cfg = measure(schedule), measured_model(schedule)
        print(f"measured bubble fraction: {float(measured.bubble_fraction):.3f} (one step of a GPT "
              f"of {cfg.n_layers} blocks, hidden {cfg.hidden}, {cfg.seq_len} tokens, on {schedule.pp} "
              f"processes; makespan {measured.makespan:.3g} s)")
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")        # a file, no window
        from .plot import draw_comparison, draw_timeline
        peaks = report.peak_activations
        if measured is None:
            ax = draw_timeline(simulated, unit="time (cost units)", peaks=peaks)
            fig = ax.figure
        else:
            fig = draw_comparison(simulated, measured, peaks=peaks)
        fig.savefig(args.plot, dpi=120, bbox_inches="tight")
        print(f"timeline drawn to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
