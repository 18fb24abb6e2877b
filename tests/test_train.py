"""python -m minitron.train: a short run writes metrics, a plot and checkpoints and resumes from
them; every bad input is one line on stderr and exit code 2."""
import json
import os

import pytest

from minitron.train import cli as train

TINY = ["--steps", "6", "--hidden", "32", "--seq", "16", "--batch", "4", "--layers", "2",
        "--eval-every", "3", "--save-every", "3", "--sample", "20", "--lr", "1e-2"]


def test_a_short_run_and_its_resume(tmp_path, capfd):
    out = str(tmp_path / "run")
    assert train.main(TINY + ["--dp", "2", "--out", out]) == 0
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert "eval_loss" in rows[2] and "eval_loss" in rows[5]
    assert os.path.getsize(os.path.join(out, "loss.png")) > 1000
    latest = os.path.join(out, "checkpoints", "latest")
    assert os.path.realpath(latest).endswith("step_000006")
    printed = capfd.readouterr()
    assert "sample: The " in printed.out and "tok/s" in printed.err
    # resumed on another grid (pp=2 instead of dp=2): continues at step 7
    more = TINY[:]
    more[1] = "8"
    assert train.main(more + ["--pp", "2", "--out", out, "--resume", latest, "--sample", "0"]) == 0
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in rows][-2:] == [7, 8]


@pytest.mark.parametrize("argv, message", [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--tp", "3"], "not divisible"),
    (["--pp", "4"], "pipeline"),
    (["--batch", "5", "--dp", "2"], "--batch 5"),
    (["--corpus", "/nonexistent/x.txt"], "does not exist"),
    (["--out", "/proc/minitron-cannot-write"], "cannot write"),
    (["--resume", "/nonexistent/ckpt"], "no such checkpoint"),
    (["--ep", "2", "--experts", "4", "--dtype", "bfloat16"], "use --dtype float32"),
    (["--micro-batch", "3"], "--micro-batch 3"),
    (["--schedule", "1f1b"], "needs a pipeline"),
    (["--pp", "2", "--schedule", "nope"], "unknown schedule"),
    (["--zero", "3", "--dp", "2", "--batch", "3"], "--batch 3"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capfd, argv, message):
    if "--out" not in argv:
        argv = argv + ["--out", str(tmp_path / "run")]
    assert train.main(argv) == 2
    err = capfd.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("minitron.train: error:")
    assert message in err, err
