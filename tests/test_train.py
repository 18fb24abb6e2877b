"""python -m minitron.train: a short run writes metrics, a plot and checkpoints and resumes from
them; a diverging run stops and leaves the good run as it was; every bad input is one line on
stderr and exit code 2."""
import json
import math
import multiprocessing as mp
import os
import re
import shutil

import pytest

from minitron.runtime.launch import RankError
from minitron.train import cli as train, out_dir

TINY = ["--steps", "6", "--hidden", "32", "--seq", "16", "--batch", "4", "--layers", "2",
        "--eval-every", "3", "--save-every", "3", "--sample", "20", "--lr", "1e-2"]


def rows_of(out):
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


@pytest.fixture(scope="module")
def good_run(tmp_path_factory):
    """A 6-step dp=2 run with checkpoints at steps 3 and 6, and what it printed."""
    out = str(tmp_path_factory.mktemp("good") / "run")
    assert train.main(TINY + ["--dp", "2", "--out", out]) == 0
    return out


@pytest.fixture
def run_copy(good_run, tmp_path):
    out = str(tmp_path / "run")
    shutil.copytree(good_run, out, symlinks=True)
    return out


def test_a_short_run(good_run):
    rows = rows_of(good_run)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert "eval_loss" in rows[2] and "eval_loss" in rows[5]
    assert os.path.getsize(os.path.join(good_run, "loss.png")) > 1000
    latest = os.path.join(good_run, "checkpoints", "latest")
    assert os.path.realpath(latest).endswith("step_000006")


def test_resume_on_another_grid_drops_the_rows_past_its_checkpoint(run_copy, capfd):
    """Resumed from step 3 (as if the step-6 save had been killed) on pp=2 instead of dp=2:
    metrics.jsonl holds steps 1-8 once each, not 1-6 then 4-8."""
    more = TINY[:]
    more[1] = "8"
    step3 = os.path.join(run_copy, "checkpoints", "step_000003")
    assert train.main(more + ["--pp", "2", "--out", run_copy, "--resume", step3]) == 0
    assert [r["step"] for r in rows_of(run_copy)] == list(range(1, 9))
    printed = capfd.readouterr()
    assert "sample: The " in printed.out and "tok/s" in printed.err
    sample = next(line for line in printed.out.splitlines() if line.startswith("sample: "))
    assert sample.isprintable(), sample   # escaped (tests/test_data.py): no control byte printed


def test_a_diverging_run_stops_and_keeps_the_good_run(run_copy, capfd):
    """--lr 1e30 is finite, so it is accepted; the loss turns NaN at the step after the first
    update: exit 1 naming the step, no checkpoint after it, `latest`, the plot and the finite
    rows untouched."""
    plot = open(os.path.join(run_copy, "loss.png"), "rb").read()
    latest = os.path.join(run_copy, "checkpoints", "latest")
    more = TINY[:]
    more[1] = "12"
    assert train.main(more + ["--out", run_copy, "--resume", latest, "--lr", "1e30"]) == 1
    err = capfd.readouterr().err.strip().splitlines()[-1]
    assert re.search(r"FloatingPointError: step 8: the loss is (nan|inf): the run diverged", err), err
    assert os.path.realpath(latest).endswith("step_000006")
    assert sorted(os.listdir(os.path.join(run_copy, "checkpoints"))) == \
        ["latest", "step_000003", "step_000006"]
    assert open(os.path.join(run_copy, "loss.png"), "rb").read() == plot
    rows = rows_of(run_copy)
    assert [r["step"] for r in rows] == list(range(1, 8)) and all(math.isfinite(r["loss"]) for r in rows)


def test_a_run_into_an_existing_run_is_refused_or_replaced_saying_what(run_copy, capfd):
    before = sorted(os.listdir(run_copy))
    assert train.main(TINY + ["--out", run_copy]) == 2
    err = capfd.readouterr().err.strip()
    assert err == (f"minitron.train: error: --out {run_copy} already holds a run (metrics.jsonl, "
                   f"loss.png, checkpoints): pass --resume {run_copy}/checkpoints/latest to "
                   "continue it, --overwrite to replace it, or another --out")
    assert sorted(os.listdir(run_copy)) == before
    args = train.parser().parse_args(TINY + ["--out", run_copy, "--overwrite"])
    train.configure(args)
    out_dir.claim_out(args)                # what main does before the ranks start
    assert f"--overwrite: removing metrics.jsonl, loss.png, checkpoints from {run_copy}" in \
        capfd.readouterr().err
    assert out_dir.existing_run(run_copy) == []


def _probe_many(out, times, failures):
    for _ in range(times):
        try:
            out_dir.check_writable(out)
        except ValueError:
            with failures.get_lock():
                failures.value += 1


def test_processes_probing_one_out_at_once_all_succeed(tmp_path):
    """torchrun starts every process's checks at once: four of them probe --out 300 times each
    (a probe of one shared name failed about 1 call in 40)."""
    ctx = mp.get_context("fork")
    failures = ctx.Value("i", 0)
    procs = [ctx.Process(target=_probe_many, args=(str(tmp_path), 300, failures)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * 4 and failures.value == 0
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("argv, message", [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--tp", "3"], "not divisible"),
    (["--pp", "4"], "pipeline"),
    (["--batch", "5", "--dp", "2"], "--batch 5"),
    (["--corpus", "/nonexistent/x.txt"], "does not exist"),
    (["--out", "/proc/minitron-cannot-write"], "cannot write"),
    (["--resume", "/nonexistent/ckpt"], "no such checkpoint"),
    (["--micro-batch", "3"], "--micro-batch 3"),
    (["--schedule", "1f1b"], "needs a pipeline"),
    (["--pp", "2", "--schedule", "nope"], "unknown schedule"),
    (["--zero", "3", "--dp", "2", "--batch", "3"], "--batch 3"),
    (["--lr", "nan"], "--lr nan: the learning rate must be a finite number > 0; use --lr 3e-4"),
    (["--lr", "inf"], "--lr inf: the learning rate must be a finite number > 0"),
    (["--lr", "-1"], "--lr -1: the learning rate must be a finite number > 0"),
    (["--save-every", "-1"], "--save-every -1: the checkpoint interval"),
    (["--microbatches", "0"], "--microbatches 0: the micro-batches per step must be an integer >= 1"),
    (["--peak-tflops", "-1"], "--peak-tflops -1: a device's peak TFLOP/s must be a finite number > 0"),
    (["--sample", "-5"], "--sample -5"),
    (["--steps", "0"], "--steps 0: the number of steps must be an integer >= 1"),
    (["--overwrite", "--resume", "x"], "--overwrite with --resume"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capfd, argv, message):
    if "--out" not in argv:
        argv = argv + ["--out", str(tmp_path / "run")]
    assert train.main(argv) == 2
    err = capfd.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("minitron.train: error:")
    assert message in err, err


@pytest.mark.parametrize("manifest", ['{"format": 1}', "[1, 2]", '{"format": 1, "files": {}}'],
                         ids=["format-only", "list", "no-model"])
def test_a_malformed_manifest_is_refused_naming_it(tmp_path, capfd, manifest):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "manifest.json").write_text(manifest)
    assert train.main(["--out", str(tmp_path / "run"), "--resume", str(ckpt)]) == 2
    err = capfd.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{ckpt}/manifest.json is not a minitron manifest" in err


def test_a_corpus_too_short_is_refused_before_any_rank_starts(tmp_path, capfd):
    short = tmp_path / "short.txt"
    short.write_bytes(b"0123456789")
    assert train.main(["--out", str(tmp_path / "run"), "--corpus", str(short)]) == 2
    err = capfd.readouterr().err.strip()
    assert err.startswith(f"minitron.train: error: corpus {short} has 10 bytes") and "--seq 64" in err


def test_a_rank_error_is_one_line_naming_the_rank_once():
    death = "rank 1 died with signal SIGKILL while in: running (last: all_reduce on group 'dp' [0, 1])"
    assert train.one_line(RankError(death)) == death
    raised = "rank 0 raised:\nTraceback (most recent call last):\n  File x\nKeyError: 'k'"
    assert train.one_line(RankError(raised)) == "rank 0 raised: KeyError: 'k'"
