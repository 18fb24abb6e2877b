"""The CPU scaling sweep (python -m minitron.bench scaling): its runs, its refusals, its committed
results (which lesson 13 reads), and the planner's prediction for a CPU."""
import csv
import pathlib

import pytest

from minitron.bench import cli
from minitron.bench.scaling import FIELDS, RANKS, WEAK_TP_HIDDEN, predict, sweeps

RESULTS = pathlib.Path(__file__).resolve().parent.parent / "bench" / "results" / "scaling.csv"
MACHINE = {"peak": 50e9, "matmul_eff": 0.8, "mem_bw": 5e9, "link_bw": 1e9, "latency": 1e-4, "cores": 2}


def test_four_sweeps_on_1_to_8_ranks_with_weak_tp_work_per_rank_about_fixed():
    runs = list(sweeps())
    assert {r[0] for r in runs} == {"dp strong", "dp weak", "tp strong", "tp weak"}
    assert len(runs) == 4 * len(RANKS)
    per_rank = [h * h / n for n, h in WEAK_TP_HIDDEN.items()]
    assert max(per_rank) / min(per_rank) < 1.15


@pytest.mark.parametrize("argv, says", [(["--ranks", "1,3"], "--ranks 1,3"), (["--ranks", "2,4"], "--ranks 2,4"),
                                        (["--steps", "0"], "--steps 0"), (["--passes", "0"], "--passes 0")])
def test_bad_flags_exit_2_before_any_rank(argv, says, capsys):
    assert cli.main(["scaling", *argv]) == 2
    assert says in capsys.readouterr().err


def test_committed_results_have_both_numbers_and_where_they_came_from():
    with open(RESULTS) as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == FIELDS and len(rows) == 4 * len(RANKS)
    for r in rows:
        assert r["date"] and r["machine"] and r["command"].startswith("python -m minitron.bench scaling")
        assert 0 < float(r["mfu"]) <= 1 and float(r["efficiency"]) > 0
        if r["ranks"] == "1":
            assert float(r["efficiency"]) == 1.0


def test_cpu_prediction_takes_turns_beyond_the_cores_and_tp_pays_per_layer():
    one = predict("dp strong", 1, 256, 8, MACHINE)
    assert predict("dp weak", 4, 256, 32, MACHINE) > 2 * 0.95 * one       # 4 ranks on 2 cores
    # at 8 ranks TP's all-reduces in every layer cost more than DP's one per step (at 2 the
    # untied embedding and output layer that every DP rank updates whole still weigh more)
    assert predict("tp strong", 8, 256, 8, MACHINE) > predict("dp strong", 8, 256, 8, MACHINE)
