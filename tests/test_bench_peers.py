"""python -m minitron.bench peers: the table's shape and the numerics check (never the timings)."""
import re

import pytest

from minitron.bench import peers
from minitron.bench.cli import main


def test_quick_mode_prints_every_pair_with_agreeing_losses(capsys):
    assert main(["peers", "--quick"]) == 0
    out = capsys.readouterr().out
    rows = {ln.split("  ")[0]: ln for ln in out.splitlines() if ln.startswith(peers.PAIRS)}
    assert list(rows) == list(peers.PAIRS)
    number = r"(\d+\.\d+)"
    for pair, line in rows.items():
        m = re.search(rf"{number} / {number}\s+{number}\s+{number}\s+{number}  {number}-{number}   (.+)$", line)
        assert m, line
        ours, theirs, ms_ours, ms_theirs, ratio, q1, q3, verdict = m.groups()
        assert ours == theirs                   # same loss to the 5 decimals printed
        assert float(q1) <= float(ratio) <= float(q3)
        assert "DIFFER" not in verdict


def _ranks(loss_ours: float, loss_theirs: float) -> list[dict]:
    times = [(0.010, 0.011), (0.012, 0.010), (0.009, 0.010)]
    rank = {name: {"losses": [loss_ours, loss_theirs], "times": times} for name in peers.PAIRS}
    return [rank, {name: {"losses": [None, None], "times": times} for name in peers.PAIRS}]


def test_a_loss_that_differs_is_caught_before_any_timing_counts():
    cfg, batch = peers.QUICK_CONFIG, 8
    same = peers.summarize(_ranks(4.8601, 4.8601), cfg, batch)
    assert all(r["same_loss"] for r in same)
    q1, med, q3 = same[0]["ratio"]
    ratios = sorted(a / b for a, b in _ranks(0, 0)[0][peers.PAIRS[0]]["times"])
    assert ratios[0] <= q1 <= med == ratios[1] <= q3 <= ratios[2]   # rank 0's rounds' ratios
    off = peers.summarize(_ranks(4.8601, 4.8601 * (1 + 1e-4)), cfg, batch)
    assert not any(r["same_loss"] for r in off)


def test_bad_options_are_refused_naming_the_flag(capsys):
    for argv, flag in ((["--rounds", "0"], "--rounds"), (["--batch", "6"], "--batch")):
        with pytest.raises(SystemExit) as e:
            peers.run(argv)
        assert e.value.code == 2 and flag in capsys.readouterr().err


def test_a_median_above_one_is_never_called_at_or_below_one():
    from minitron.bench.peers import ratio_verdict
    assert ratio_verdict(0.95, 1.00) == "<= 1.0"
    assert ratio_verdict(0.98, 1.03) == "ABOVE 1.0 (its IQR reaches 1.0)"   # once "<= 1.0 within spread"
    assert ratio_verdict(1.01, 1.03) == "ABOVE 1.0"
