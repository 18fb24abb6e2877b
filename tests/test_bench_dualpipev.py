"""python -m minitron.bench dualpipev: the hidden share's arithmetic on a hand-made timeline
(and two planted wrong ones it catches), the costs fitted from a timeline, and one short run."""
from __future__ import annotations

import csv
import re

import pytest

from minitron.bench import cli as bench_cli
from minitron.bench import dualpipev_timeline as bench

# One rank's recorded segments (seconds): the F's first all-to-all is in flight 2-6 while the BW
# computes 2-4 and its W-like tail 3-5 (overlapping: union 2-5, 3 s inside); the F's own compute
# 5-6 does not count (a half never hides its own all-to-all); the BW's all-to-all 7-9 has
# nothing beside it. 6 s of all-to-all, 3 inside: half hidden.
HAND_MADE = [("compute", "F1@s0", 0.0, 2.0), ("all_to_all", "F1@s0", 2.0, 6.0),
             ("compute", "BW0@s3", 2.0, 4.0), ("compute", "W0@s3", 3.0, 5.0),
             ("compute", "F1@s0", 5.0, 6.0), ("all_to_all", "BW0@s3", 7.0, 9.0),
             ("compute", "BW0@s3", 9.0, 10.0)]


def _double_counting(spans):        # plant: overlapping computes counted twice
    return list(spans)


def _touching_counts_whole(s, e, spans):   # plant: an all-to-all that meets a compute, all hidden
    return (e - s) if any(min(e, hi) > max(s, lo) for lo, hi in spans) else 0.0


@pytest.mark.parametrize("plant", [None, "double-count", "touching-counts-whole"])
def test_the_hidden_share_of_a_hand_made_timeline(monkeypatch, plant):
    if plant == "double-count":
        monkeypatch.setattr(bench, "_union", _double_counting)
    if plant == "touching-counts-whole":
        monkeypatch.setattr(bench, "_inside", _touching_counts_whole)
    figures = bench.hidden_share(HAND_MADE)
    right = figures == pytest.approx({"comm": 6.0, "inside": 3.0, "exposed": 3.0, "hidden": 0.5})
    assert right == (plant is None), (plant, figures)


def test_without_overlap_nothing_is_hidden():
    apart = [("compute", "F0@s0", 0.0, 1.0), ("all_to_all", "F0@s0", 1.0, 2.0),
             ("compute", "F0@s0", 2.0, 3.0), ("compute", "BW0@s1", 3.0, 4.0),
             ("all_to_all", "BW0@s1", 4.0, 4.5)]
    assert bench.hidden_share(apart)["hidden"] == 0.0


def test_costs_fitted_from_a_timeline_are_per_stage():
    """A rank holds 2 chunks, so a stage costs twice an action: F 1+1 s -> F = 4; BW 3 s, W 0.5
    -> B = 2 * 2.5; the all-to-all 0.5 per F / BW -> comm = 1 (W's none)."""
    segs = [("compute", "F0@s0", 0, 1), ("all_to_all", "F0@s0", 1, 1.5), ("compute", "F0@s0", 1.5, 2.5),
            ("compute", "BW0@s1", 3, 6), ("all_to_all", "BW0@s1", 6, 6.5), ("compute", "W1@s1", 7, 7.5)]
    c = bench.fitted_costs(segs)
    assert (c.F, c.B, c.W, c.comm) == pytest.approx((4.0, 5.0, 1.0, 1.0))


def test_the_bench_runs_and_reports(capsys, tmp_path):
    png, table = tmp_path / "t.png", tmp_path / "t.csv"
    argv = ["dualpipev", "--microbatches", "4", "--repeats", "1", "--plot", str(png), "--csv", str(table)]
    assert bench_cli.main(argv) == 0
    out = capsys.readouterr().out
    hidden = re.search(r"all-to-all time hidden behind the other half's compute +(\d+\.\d)% .*"
                       r"without overlap (\d+\.\d)%", out)
    assert hidden, out
    assert float(hidden[1]) > 0 and float(hidden[2]) == 0.0, out
    assert re.search(r"ratio overlap / no overlap \d+\.\d{3}", out), out
    assert re.search(r"prediction \(simulator.*ratio \d\.\d{3}, \d+% hidden", out), out
    rows = list(csv.DictReader(table.open()))
    assert [r["mode"] for r in rows[:2]] == ["overlap", "no overlap"] and "CPU run" in rows[0]["note"]
    assert png.stat().st_size > 10_000


def test_bad_options_are_refused_in_one_line(capsys):
    with pytest.raises(SystemExit):
        bench_cli.main(["dualpipev", "--ep", "1"])
    assert "--ep 1: both must be >= 2" in capsys.readouterr().err
