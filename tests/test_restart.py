"""python -m minitron.train --max-restarts N: a rank killed (or raising) at a chosen step stops
the run, every rank restarts from the last complete checkpoint, and the loss curve is the
uninterrupted run's, step for step and bit for bit (dropout on), one metrics row per step.
The fault is planted from verify/faults.py (rank_dies_at: the forked ranks inherit its patch), in
the first launch only."""
import argparse
import json
import os

import pytest

from minitron.train import cli as train, restart
from minitron.train.out_dir import UsageError
from minitron.verify.faults import rank_dies_at

RUN = ["--steps", "6", "--hidden", "32", "--seq", "16", "--batch", "4", "--layers", "2",
       "--dropout", "0.1", "--eval-every", "3", "--save-every", "2", "--sample", "0",
       "--lr", "1e-2", "--dp", "2"]


def rows_of(out):
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def curve(rows):
    return [(r["step"], r["loss"], r.get("eval_loss"), r["lr"]) for r in rows]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("straight") / "run")
    assert train.main(RUN + ["--out", out]) == 0
    return out


@pytest.mark.parametrize("fault,restarted_from", [
    ((3, 1, "kill"), "the checkpoint of step 2"),   # SIGKILL at step 4: steps 3-4 run again
    ((1, 0, "raise"), "step 0 (no checkpoint yet)"),  # before the first save: from the start
])
def test_a_dead_rank_restarts_and_the_curve_is_the_uninterrupted_one(
        uninterrupted, tmp_path, capfd, monkeypatch, fault, restarted_from):
    out = str(tmp_path / "run")
    with rank_dies_at(*fault):
        assert train.main(RUN + ["--out", out, "--max-restarts", "1"]) == 0
    err = capfd.readouterr().err
    died = "died with signal SIGKILL" if fault[2] == "kill" else "raised"
    assert f"rank {fault[1]} {died}" in err and f"restart 1 of 1 from {restarted_from}" in err, err
    assert curve(rows_of(out)) == curve(rows_of(uninterrupted))      # exactly, one row a step


def test_without_restarts_a_dead_rank_ends_the_run(tmp_path, capfd, monkeypatch):
    with rank_dies_at(0, 1, "raise"):
        assert train.main(RUN + ["--out", str(tmp_path / "run")]) == 1
    err = capfd.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("minitron.train: error: rank 1 raised") and "planted fault" in err, err


@pytest.mark.parametrize("value", ["-1", "1.5"])
def test_a_bad_max_restarts_exits_2_naming_the_flag(tmp_path, capfd, value):
    assert train.main(RUN + ["--out", str(tmp_path / "run"), "--max-restarts", value]) == 2
    err = capfd.readouterr().err
    assert "--max-restarts" in err and ("--max-restarts 3" in err or "invalid int" in err), err


def test_a_process_torchrun_restarted_continues_from_the_latest_checkpoint(
        uninterrupted, monkeypatch):
    args = argparse.Namespace(out=uninterrupted, resume=None, overwrite=True, max_restarts=0)
    restart.continue_under_torchrun(args)                 # the first attempt: as it is
    assert (args.resume, args.overwrite) == (None, True)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    restart.continue_under_torchrun(args)
    assert args.resume == os.path.join(uninterrupted, "checkpoints", "latest")
    assert args.overwrite is False
    with pytest.raises(UsageError, match="torchrun --max-restarts N"):
        restart.continue_under_torchrun(argparse.Namespace(out=uninterrupted, max_restarts=2))
