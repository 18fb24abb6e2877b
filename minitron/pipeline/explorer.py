"""The bubble explorer: move a control, see the schedule's timeline, bubble and memory change.

In a notebook (needs ipywidgets, which `make lab` installs):

    from minitron.pipeline.explorer import explore, show
    show(schedule="1f1b", pp=4, microbatches=8)     # a static picture: text nbval can compare
    explore(schedule="1f1b", pp=4, microbatches=8)   # the same, with controls that redraw it

Both build the schedule (schedules.py), check it (check.py: per-rank peak activations) and
simulate it (simulate.py) with the chosen F:B:W costs and message latency, then draw it
(plot.py). The explorer writes the bubble fraction as text ("bubble fraction: 0.273") in a
widget of its own, so a reader, or a browser test, finds the number in the page.
"""
from __future__ import annotations

import dataclasses
import io
from fractions import Fraction

import matplotlib.pyplot as plt

from .check import check
from .plot import draw_timeline
from .schedules import SCHEDULES, make_schedule
from .simulate import Costs, simulate

# The CSS classes a page (and tests/test_browser.py) finds the explorer's numbers by.
BUBBLE_CLASS, PEAKS_CLASS = "minitron-bubble", "minitron-peaks"


@dataclasses.dataclass(frozen=True)
class Setting:
    """Everything the picture depends on."""
    schedule: str = "1f1b"
    pp: int = 4
    microbatches: int = 8
    virtual: int = 1
    F: float = 1
    B: float = 1
    W: float = 1
    latency: float = 0

    def costs(self) -> Costs:
        exact = [Fraction(x).limit_denominator(1000) for x in (self.F, self.B, self.W, self.latency)]
        return Costs(*exact)          # slider floats as exact fractions: no rounding noise


@dataclasses.dataclass
class Result:
    setting: Setting
    timeline: object          # actions.Timeline
    peaks: dict               # rank -> peak micro-batches alive (full-stage units)

    def __repr__(self) -> str:     # short and stable: a notebook may display it
        return f"Result({self.setting}, {self.bubble_text})"

    @property
    def bubble_text(self) -> str:
        return f"bubble fraction: {float(self.timeline.bubble_fraction):.3f}"

    @property
    def peaks_text(self) -> str:
        return "peak activations per rank (micro-batches in flight): " + ", ".join(
            f"rank {r}: {float(p):.3g}" for r, p in sorted(self.peaks.items()))


def run(setting: Setting) -> Result:
    """Build, check and simulate one setting; ValueError (with the fix) if it cannot be built."""
    schedule = make_schedule(setting.schedule, setting.pp, setting.microbatches, setting.virtual)
    report = check(schedule)
    return Result(setting, simulate(schedule, setting.costs()), report.peak_activations)


def figure(result: Result):
    """The timeline of `result`, one row per rank, with each rank's peak activations."""
    s = result.setting
    fig, ax = plt.subplots(figsize=(11, 0.5 * s.pp + 1.4))
    title = (f"{s.schedule}, pp={s.pp}, m={s.microbatches}"
             + (f", v={s.virtual}" if s.virtual > 1 else "")
             + f", F:B:W = {s.F:g}:{s.B:g}:{s.W:g}" + (f", latency {s.latency:g}" if s.latency else ""))
    draw_timeline(result.timeline, ax, title, unit="time (cost units)", peaks=result.peaks)
    return fig                       # drawn with bbox_inches="tight": the legend outside is kept


def show(**setting) -> Result:
    """Print the bubble fraction and the peaks of a setting and draw its timeline (static)."""
    result = run(Setting(**setting))
    print(result.bubble_text)
    print(result.peaks_text)
    fig = figure(result)
    plt.show()
    plt.close(fig)
    return result


def virtuals_of(name: str) -> list[int]:
    """The chunk counts per rank a schedule accepts (1..4), found by building a small one."""
    ok = []
    for v in range(1, 5):
        try:
            make_schedule(name, 2, 4, v)
            ok.append(v)
        except ValueError:
            pass
    return ok


class Explorer:
    """Controls for every field of Setting; each change recomputes and redraws."""

    def __init__(self, **setting):
        import ipywidgets as widgets    # here: the package itself does not need ipywidgets
        start = Setting(**setting)
        slider = dict(continuous_update=False, style={"description_width": "initial"})
        cost = dict(min=0.25, max=4.0, step=0.25, readout_format=".2f", **slider)
        self.controls = dict(
            schedule=widgets.Dropdown(options=list(SCHEDULES), value=start.schedule,
                                      description="schedule"),
            pp=widgets.IntSlider(value=start.pp, min=1, max=8, description="pp", **slider),
            microbatches=widgets.IntSlider(value=start.microbatches, min=1, max=32,
                                           description="micro-batches", **slider),
            virtual=widgets.IntSlider(value=start.virtual, min=1, max=4, description="chunks per rank",
                                      **slider),
            F=widgets.FloatSlider(value=start.F, description="F", **cost),
            B=widgets.FloatSlider(value=start.B, description="B", **cost),
            W=widgets.FloatSlider(value=start.W, description="W", **cost),
            latency=widgets.FloatSlider(value=start.latency, min=0.0, max=2.0, step=0.05,
                                        description="latency", **slider))
        self.bubble = widgets.HTML()
        self.bubble.add_class(BUBBLE_CLASS)
        self.peaks = widgets.HTML()
        self.peaks.add_class(PEAKS_CLASS)
        self.out = widgets.Output()
        self.result: Result | None = None
        self.error: str | None = None
        self._quiet = False
        c = self.controls
        self.widget = widgets.VBox([
            widgets.HBox([c["schedule"], c["pp"], c["microbatches"], c["virtual"]]),
            widgets.HBox([c["F"], c["B"], c["W"], c["latency"]]),
            self.bubble, self.peaks, self.out])
        self._fit_virtual()
        c["schedule"].observe(self._on_schedule, "value")
        for name, control in c.items():
            if name != "schedule":
                control.observe(self.update, "value")
        self.update()

    @property
    def setting(self) -> Setting:
        return Setting(**{name: control.value for name, control in self.controls.items()})

    def _fit_virtual(self):
        """Only the chunk counts the chosen schedule accepts; fixed ones disable the slider."""
        allowed, virtual = virtuals_of(self.controls["schedule"].value), self.controls["virtual"]
        if virtual.value not in allowed:
            virtual.value = allowed[0]
        virtual.disabled = len(allowed) == 1

    def _on_schedule(self, change=None):
        self._quiet = True               # fitting `virtual` would redraw once more
        try:
            self._fit_virtual()
        finally:
            self._quiet = False
        self.update()

    def update(self, change=None):
        """Recompute the current setting; show its numbers and redraw, or say what to change."""
        if self._quiet:
            return
        try:
            result = run(self.setting)
        except ValueError as err:
            self.result, self.error = None, str(err)
            self.bubble.value = f"bubble fraction: (none) {self.error}"
            self.peaks.value = ""
            if _in_kernel():
                self.out.clear_output()
            return
        self.result, self.error = result, None
        self.bubble.value = result.bubble_text
        self.peaks.value = result.peaks_text
        if _in_kernel():                 # elsewhere (a test) there is no page to draw on
            from IPython.display import Image, display
            fig = figure(result)
            png = io.BytesIO()           # a PNG of our own: the same whatever matplotlib backend
            fig.savefig(png, format="png", dpi=80, bbox_inches="tight")
            plt.close(fig)
            with self.out:
                self.out.clear_output(wait=True)
                display(Image(png.getvalue()))


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return getattr(get_ipython(), "kernel", None) is not None


def explore(**setting) -> Explorer:
    """Display an Explorer (in a notebook) and return it."""
    from IPython.display import display
    explorer = Explorer(**setting)
    display(explorer.widget)
    return explorer
