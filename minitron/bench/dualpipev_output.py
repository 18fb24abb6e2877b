"""The dualpipev bench's outputs (bench/dualpipev.py): its timelines drawn, its steps in a CSV."""
from __future__ import annotations

import csv
import datetime
import os

from .dualpipev_timeline import _LABEL, _ms, measured_timeline


def draw_segments(segments: dict[int, list], pp: int, ax, title: str):
    """Each pipeline rank's recorded compute segments (coloured by kind, lighter: its second
    chunk) and, in the strip below them, its all-to-alls in flight (grey), in ms."""
    from matplotlib.collections import PolyCollection
    from ..pipeline.plot import box_color

    boxes, colors = [], []
    for r, segs in segments.items():
        for kind, label, s, e in _ms(segs):
            what = _LABEL.match(label)
            if kind == "compute":
                y0, y1, color = r - 0.4, r + 0.1, box_color(what[1], int(int(what[3]) >= pp))
            else:
                y0, y1, color = r + 0.15, r + 0.4, (0.45, 0.45, 0.45)
            boxes.append([(s, y0), (e, y0), (e, y1), (s, y1)])
            colors.append(color)
    ax.add_collection(PolyCollection(boxes, facecolors=colors, edgecolors="black", linewidths=0.3))
    ax.autoscale_view()
    ax.set_ylim(pp - 0.5, -0.5)
    ax.set_yticks(range(pp), [f"rank {r}" for r in range(pp)])
    ax.set_title(title, fontsize=9)
    return ax


def plot(summary: dict, pp: int, path: str | None = None):
    """The simulator's overlapped timeline (fitted costs, ms) above the two measured ones;
    saved into `path` (and closed), else the Figure returned."""
    import matplotlib.pyplot as plt
    from ..pipeline.plot import draw_timeline

    fig, axes = plt.subplots(3, 1, figsize=(11, 1.2 * pp * 3 + 1.5), sharex=True)
    draw_timeline(summary["simulated"], axes[0], "simulated, overlap=True (costs fitted to the "
                  "measured run without overlap)", unit="ms")
    for ax, key, what in ((axes[1], "plain", "without overlap"), (axes[2], "ours", "with overlap")):
        step = summary[key]
        _, segments = measured_timeline(step)
        hidden = step["hidden"]
        draw_segments(segments, pp, ax, f"measured {what} (ep rank 0 of each pipeline rank; grey: "
                      f"all-to-alls in flight): step {1e3 * step['step']:.0f} ms, "
                      f"{100 * hidden:.0f}% of the all-to-all hidden")
    axes[2].set_xlabel("ms from the step's start (the simulator: its makespan in the fitted costs' ms)")
    longest = max(float(summary["simulated"].makespan), 1e3 * summary["plain"]["step"],
                  1e3 * summary["ours"]["step"])
    axes[0].set_xlim(0, longest)
    axes[0].set_xlabel("")
    fig.tight_layout()
    if path is None:
        return fig
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write_csv(path: str, measured: dict, summary: dict, command: str) -> None:
    from .overhead import machine
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    note = (f"CPU run (gloo) on a loaded {os.cpu_count()}-core machine, 1-min load average "
            f"{os.getloadavg()[0]:.1f}")
    rows = [(("overlap" if s["overlap"] else "no overlap"), s["round"], 1e3 * s["step"],
             1e3 * s["comm"], 1e3 * s["inside"], s["hidden"]) for s in measured["steps"]]
    rows += [("median overlap", "", 1e3 * summary["step"], "", "", summary["hidden"]),
             ("median no overlap", "", 1e3 * summary["step_plain"], "", "", summary["hidden_plain"]),
             ("ratio overlap / no overlap", "", summary["ratio"], "", "", ""),
             ("simulated ratio (fitted costs)", "", summary["simulated_ratio"], "", "",
              summary["simulated_hidden"])]
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["mode", "round", "step_ms", "all_to_all_ms", "hidden_ms", "hidden_share",
                      "date", "machine", "note", "command"])
        for row in rows:
            out.writerow([f"{x:.4g}" if isinstance(x, float) else x for x in row]
                         + [when, machine(), note, command])
