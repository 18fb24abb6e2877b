"""Draw a pipeline timeline: one row per rank, one box per compute action, idle time left empty.

The same picture for a simulated run (times in cost units, F = 1) and a measured one (seconds):
both are Timelines (minitron.pipeline.actions). `draw_timeline` draws one on an Axes;
`draw_comparison` draws a simulated and a measured run one above the other, each on its own
makespan (x from 0 to 1), since their units differ and only their shapes are comparable.

Nothing drawn depends on the clock of the run that draws it: the texts are the micro-batch
numbers, the rank names and the bubble fraction rounded to three digits.
"""
from __future__ import annotations

import matplotlib.colors as mcolors
import matplotlib.pyplot as plt
from matplotlib.collections import PolyCollection
from matplotlib.patches import Patch

from .actions import B, BW, F, W, Timeline

# One colour per kind of work, the same in every figure of the course.
KIND_COLORS = {F: "tab:blue", B: "tab:orange", W: "tab:green", BW: "tab:red"}
KIND_NAMES = {F: "F forward", B: "B input grad", W: "W weight grad", BW: "BW full backward"}
# A rank's second, third... model chunk (interleaving, ZB-V) in a lighter shade of the same colour.
CHUNK_LIGHTEN = 0.45
MAX_LABELLED_PER_ROW = 48       # beyond this the numbers would not fit in their boxes


def chunk_of(timeline: Timeline) -> dict[tuple[int, int], int]:
    """(rank, stage) -> which of the rank's chunks it is (0 = its earliest stage in the model)."""
    stages: dict[int, set[int]] = {}
    for e in timeline.events:
        stages.setdefault(e.rank, set()).add(e.stage)
    return {(rank, s): k for rank, held in stages.items() for k, s in enumerate(sorted(held))}


def box_color(kind: str, chunk: int) -> tuple[float, float, float]:
    """The kind's colour, mixed with white once more for every later chunk."""
    rgb = mcolors.to_rgb(KIND_COLORS[kind])
    mix = 1 - (1 - CHUNK_LIGHTEN) ** chunk        # chunk 0: 0, chunk 1: 0.45, chunk 2: 0.70
    return tuple(c + (1 - c) * mix for c in rgb)


def draw_timeline(timeline: Timeline, ax=None, title: str | None = None, *, unit: str = "time",
                  normalize: bool = False, peaks: dict[int, int] | None = None):
    """Draw `timeline` on `ax` (a new figure if None) and return the Axes.

    Every box is one compute event, in event order by rank then start: the vertices and face
    colours of the Axes' one PolyCollection. Rank 0 is the top row; x starts at the first
    event's start. normalize=True divides every
    time by the makespan, so x runs from 0 to 1 whatever the unit. `peaks` (rank -> peak
    micro-batches in flight, from the checker) is written at the end of each row.
    """
    if not timeline.events:
        raise ValueError(f"timeline {timeline.name!r} has no events: nothing to draw")
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 0.55 * timeline.pp + 1.3))
    t0, span = min(e.start for e in timeline.events), float(timeline.makespan)
    scale = 1 / span if normalize else 1.0          # times may be Fractions (exact simulation)
    chunks = chunk_of(timeline)
    per_row = max(sum(e.rank == r for e in timeline.events) for r in range(timeline.pp))
    fontsize = max(5.0, min(9.0, 340 / per_row)) if per_row <= MAX_LABELLED_PER_ROW else None
    boxes, colors = [], []
    for e in sorted(timeline.events, key=lambda e: (e.rank, e.start)):
        x, width = float(e.start - t0) * scale, float(e.end - e.start) * scale
        chunk = chunks[(e.rank, e.stage)]
        y0, y1 = e.rank - 0.4, e.rank + 0.4
        boxes.append([(x, y0), (x + width, y0), (x + width, y1), (x, y1)])
        colors.append(box_color(e.kind, chunk))
        if fontsize:
            ax.text(x + width / 2, e.rank, str(e.microbatch), ha="center", va="center",
                    fontsize=fontsize, color="black" if chunk else "white")
    # One collection for every box: thousands of separate patches would take seconds to draw.
    ax.add_collection(PolyCollection(boxes, facecolors=colors, edgecolors="black", linewidths=0.5),
                      autolim=False)
    end = span * scale
    if peaks:
        for rank, peak in sorted(peaks.items()):
            ax.text(end * 1.01, rank, f"peak {float(peak):.3g}", va="center", fontsize=8)
    ax.set_xlim(0, end * (1.09 if peaks else 1.0))
    ax.set_ylim(timeline.pp - 0.5, -0.5)                 # rank 0 on top
    ax.set_yticks(range(timeline.pp), [f"rank {r}" for r in range(timeline.pp)])
    ax.set_xlabel("time / makespan" if normalize else unit)
    name = title if title is not None else timeline.name
    ax.set_title(f"{name}: bubble fraction {float(timeline.bubble_fraction):.3f}", fontsize=10)
    kinds = [k for k in KIND_COLORS if any(e.kind == k for e in timeline.events)]
    handles = [Patch(facecolor=KIND_COLORS[k], edgecolor="black", label=KIND_NAMES[k]) for k in kinds]
    if any(chunks.values()):
        handles.append(Patch(facecolor=box_color(kinds[0], 1), edgecolor="black",
                             label="lighter: a later chunk"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    return ax


def draw_comparison(simulated: Timeline, measured: Timeline, *, peaks: dict[int, int] | None = None):
    """The simulated run above the measured one, both on x = time / own makespan; returns the Figure."""
    if simulated.pp != measured.pp:
        raise ValueError(f"simulated pp={simulated.pp} but measured pp={measured.pp}: "
                         f"compare runs of the same schedule")
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(11, 1.1 * simulated.pp + 2.4))
    draw_timeline(simulated, top, f"simulated {simulated.name}", normalize=True, peaks=peaks)
    draw_timeline(measured, bottom, f"measured {measured.name}", normalize=True, peaks=peaks)
    top.set_xlabel("")
    bottom.set_xlabel("time / makespan (each run on its own makespan: cost units above, seconds below)")
    fig.subplots_adjust(hspace=0.35)     # room for the lower title (tight_layout: a slow extra draw)
    return fig
