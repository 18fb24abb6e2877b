"""Seeing the bubble: the timeline drawing, the command line and the explorer's numbers.

The drawing is checked through matplotlib's objects (one Rectangle per compute event, at its
time, in its kind's colour, with its micro-batch as text); the command line and the explorer
must print exactly the simulator's bubble fraction and the checker's peaks.
"""
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.colors as mcolors  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from minitron.pipeline import check, make_schedule  # noqa: E402
from minitron.pipeline.__main__ import main  # noqa: E402
from minitron.pipeline.actions import Event, Timeline  # noqa: E402
from minitron.pipeline.plot import KIND_COLORS, box_color, draw_comparison, draw_timeline  # noqa: E402
from minitron.pipeline.simulate import Costs, simulate  # noqa: E402


def gpipe_by_hand():
    """GPipe on 2 ranks, 2 micro-batches, F = 1, BW = 2, written out: idle 3 of 9 per rank."""
    e = [Event(0, "F", 0, 0, 0, 1), Event(0, "F", 1, 0, 1, 2), Event(1, "F", 0, 1, 1, 2),
         Event(1, "F", 1, 1, 2, 3), Event(1, "BW", 0, 1, 3, 5), Event(1, "BW", 1, 1, 5, 7),
         Event(0, "BW", 0, 0, 5, 7), Event(0, "BW", 1, 0, 7, 9)]
    return Timeline("gpipe", 2, e)


def boxes(ax):
    """(x, rank, width, colour) of every drawn box, in drawing order (one PolyCollection)."""
    (collection,) = ax.collections
    out = []
    for path, color in zip(collection.get_paths(), collection.get_facecolors()):
        (x0, y0), (x1, y1) = path.vertices.min(axis=0), path.vertices.max(axis=0)
        out.append((round(x0, 6), round((y0 + y1) / 2, 6), round(x1 - x0, 6), mcolors.to_hex(color)))
    return out


def test_one_box_per_event_at_its_time_in_its_colour_with_its_microbatch():
    timeline = gpipe_by_hand()
    ax = draw_timeline(timeline, peaks={0: 2, 1: 2})
    want = sorted((float(e.start), float(e.rank), float(e.end - e.start), mcolors.to_hex(KIND_COLORS[e.kind]))
                  for e in timeline.events)
    assert sorted(boxes(ax)) == want
    labels = sorted((round(t.get_position()[0], 6), t.get_position()[1], t.get_text()) for t in ax.texts
                    if not t.get_text().startswith("peak"))
    assert labels == sorted((float(e.start + e.end) / 2, e.rank, str(e.microbatch)) for e in timeline.events)
    assert sorted(t.get_text() for t in ax.texts if t.get_text().startswith("peak")) == ["peak 2"] * 2
    # 3 of 9 time units idle on each rank, (p-1)/(m+p-1) = 1/3, drawn as no box at all
    assert ax.get_title() == "gpipe: bubble fraction 0.333"
    assert sum(w for _, rank, w, _ in boxes(ax) if rank == 0) == 6
    plt.close("all")


def test_a_wrong_colour_or_a_missing_box_is_seen():
    """The test of the test: the comparisons above catch a drawing that mixes kinds or drops one."""
    timeline = gpipe_by_hand()
    ax = draw_timeline(timeline)
    want = sorted((float(e.start), float(e.rank), float(e.end - e.start), mcolors.to_hex(KIND_COLORS[e.kind]))
                  for e in timeline.events)
    (collection,) = ax.collections
    colors = collection.get_facecolors()
    colors[0] = mcolors.to_rgba(KIND_COLORS["BW"])
    collection.set_facecolor(colors)
    assert sorted(boxes(ax)) != want
    collection.set_verts([p.vertices for p in collection.get_paths()[1:]])
    assert len(boxes(ax)) == len(timeline.events) - 1
    plt.close("all")


def test_later_chunks_are_a_lighter_shade_and_kinds_differ():
    timeline = simulate(make_schedule("interleaved", 2, 2, 2))
    ax = draw_timeline(timeline)
    colours = {colour for _, _, _, colour in boxes(ax)}
    assert colours == {mcolors.to_hex(box_color(k, c)) for k in ("F", "BW") for c in (0, 1)}
    assert len(set(KIND_COLORS.values())) == len(KIND_COLORS)
    lighter = box_color("F", 1)
    assert all(l > d for l, d in zip(lighter, mcolors.to_rgb(KIND_COLORS["F"])))
    plt.close("all")


def test_comparison_draws_both_runs_on_their_own_makespan():
    sim = simulate(make_schedule("1f1b", 2, 3))
    slow = Timeline("1f1b", 2, [Event(e.rank, e.kind, e.microbatch, e.stage, 10 + 3 * float(e.start),
                                      10 + 3 * float(e.end)) for e in sim.events])
    fig = draw_comparison(sim, slow)
    top, bottom = fig.axes[:2]
    assert boxes(top) == boxes(bottom)                 # the same shape, seconds or cost units
    assert max(x + w for x, _, w, _ in boxes(top)) == 1.0
    assert top.get_title() == "simulated 1f1b: bubble fraction 0.250"
    with pytest.raises(ValueError, match="same schedule"):
        draw_comparison(sim, Timeline("x", 3, sim.events))
    plt.close("all")


@pytest.mark.parametrize("name, pp, m, v, costs", [("1f1b", 4, 8, None, "1,1,1"),
                                                   ("interleaved", 4, 8, 2, "1,2,1"),
                                                   ("zb-h1", 3, 6, None, "1,1,1")])
def test_cli_prints_the_simulators_bubble_and_the_checkers_peaks(capsys, tmp_path, name, pp, m, v, costs):
    argv = ["--schedule", name, "--pp", str(pp), "--microbatches", str(m), "--costs", costs,
            "--plot", str(tmp_path / "t.png")] + (["--virtual", str(v)] if v else [])
    assert main(argv) == 0
    out = capsys.readouterr().out
    schedule = make_schedule(name, pp, m, v or 1)
    f, b, w = (int(x) for x in costs.split(","))
    timeline = simulate(schedule, Costs(f, b, w))
    assert f"simulated bubble fraction: {float(timeline.bubble_fraction):.3f} " in out
    peaks = check(schedule).peak_activations
    assert ", ".join(f"rank {r}: {float(p):.3g}" for r, p in sorted(peaks.items())) in out
    assert (tmp_path / "t.png").stat().st_size > 0
    plt.close("all")


def test_cli_reproduces_the_seeds_three_eighths(capsys):
    assert main(["--schedule", "1f1b", "--pp", "4", "--microbatches", "8"]) == 0
    out = capsys.readouterr().out
    assert "simulated bubble fraction: 0.273 (idle share of pp x makespan; bubble / ideal time: 0.375)" in out
    assert "rank 0: 4, rank 1: 3, rank 2: 2, rank 3: 1" in out


@pytest.mark.parametrize("argv, says", [
    (["--schedule", "nope"], "unknown schedule 'nope'"),
    (["--schedule", "interleaved", "--microbatches", "6"], "multiple of pp"),
    (["--schedule", "1f1b", "--virtual", "2"], "virtual=2 is not supported"),
    (["--costs", "1,2"], "--costs takes three numbers"),
    (["--costs", "1,-1,1"], "Costs.B must be >= 0"),
    (["--pp", "0"], "must be >= 1"),
    (["--plot", "/no/such/folder/t.png"], "its folder does not exist"),
])
def test_cli_bad_input_is_one_line_and_exit_2(capsys, argv, says):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith("error: ") and says in err, err


def test_cli_runs_as_a_module():
    """The real command line: a process, its output and its exit codes."""
    ok = subprocess.run([sys.executable, "-m", "minitron.pipeline", "--schedule", "gpipe", "--pp", "2",
                         "--microbatches", "2"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "simulated bubble fraction: 0.333 " in ok.stdout, ok.stdout + ok.stderr
    bad = subprocess.run([sys.executable, "-m", "minitron.pipeline", "--schedule", "nope"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error: unknown schedule 'nope'"), bad.stderr


def test_explorer_update_shows_the_new_settings_bubble():
    explorer_mod = pytest.importorskip("minitron.pipeline.explorer")   # needs ipywidgets
    explorer = explorer_mod.Explorer(schedule="1f1b", pp=4, microbatches=8)
    assert explorer.bubble.value == "bubble fraction: 0.273"
    assert explorer.peaks.value.endswith("rank 0: 4, rank 1: 3, rank 2: 2, rank 3: 1")
    explorer.controls["microbatches"].value = 12          # the observer redraws
    want = simulate(make_schedule("1f1b", 4, 12)).bubble_fraction
    assert explorer.bubble.value == f"bubble fraction: {float(want):.3f}" == "bubble fraction: 0.200"
    explorer.controls["schedule"].value = "zb-v"          # fixes virtual to 2 and disables it
    assert explorer.controls["virtual"].value == 2 and explorer.controls["virtual"].disabled
    assert explorer.bubble.value == \
        f"bubble fraction: {float(simulate(make_schedule('zb-v', 4, 12, 2)).bubble_fraction):.3f}"
    explorer.controls["schedule"].value = "interleaved"
    explorer.controls["microbatches"].value = 10          # not a multiple of pp: says so, no number
    assert explorer.result is None and "multiple of pp" in explorer.bubble.value
    explorer.controls["W"].value = 2.0
    explorer.controls["microbatches"].value = 8
    want = simulate(make_schedule("interleaved", 4, 8, 2), Costs(1, 1, 2)).bubble_fraction
    assert explorer.bubble.value == f"bubble fraction: {float(want):.3f}"


def test_static_view_prints_the_numbers(capsys):
    explorer_mod = pytest.importorskip("minitron.pipeline.explorer")
    result = explorer_mod.show(schedule="gpipe", pp=4, microbatches=8)
    out = capsys.readouterr().out.splitlines()
    assert out == ["bubble fraction: 0.273",
                   "peak activations per rank (micro-batches in flight): "
                   "rank 0: 8, rank 1: 8, rank 2: 8, rank 3: 8"]
    assert result.timeline.bubble_fraction == simulate(make_schedule("gpipe", 4, 8)).bubble_fraction


def test_cli_measure_runs_the_schedule_on_processes_and_draws_both(capsys, tmp_path):
    argv = ["--schedule", "1f1b", "--pp", "2", "--microbatches", "2", "--measure", "--plot", str(tmp_path / "t.png")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "simulated bubble fraction: 0.333 " in out
    measured = [line for line in out.splitlines() if line.startswith("measured bubble fraction: ")]
    assert len(measured) == 1 and 0 < float(measured[0].split()[3]) < 1, out
    assert (tmp_path / "t.png").stat().st_size > 0
    plt.close("all")
