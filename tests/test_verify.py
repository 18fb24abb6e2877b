"""The verifier's command line: a passing run, options not built yet, and bad configurations."""
import subprocess
import sys

import pytest

from minitron import verify


def test_cli_passes_on_tp2_sp():
    run = subprocess.run([sys.executable, "-m", "minitron.verify", "--tp", "2", "--sp", "--steps", "2"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.strip().splitlines()
    assert lines[-1].startswith("PASS max_rel_err=")
    assert float(lines[-1].split("=")[1]) <= 1e-4
    rows = [line for line in lines if line.split()[0] in ("0", "1")]
    assert {line.split()[0] for line in rows} == {"0", "1"}        # both steps reported
    assert all(line.endswith("yes") for line in rows)
    assert any("grad layers.*.mlp.fc1.weight" in line for line in rows)


@pytest.mark.parametrize("option,what", [
    ("--pp", "pipeline parallelism"), ("--dp", "data parallelism"),
    ("--cp", "context parallelism"), ("--ep", "expert parallelism"),
    ("--virtual", "interleaved (virtual) pipeline parallelism")])
def test_unbuilt_dimension_exits_2(capsys, option, what):
    assert verify.main(["--tp", "2", option, "2"]) == 2
    assert f"{what} is not built yet (issue:" in capsys.readouterr().err


def test_bad_config_fails_before_launching(capsys):
    assert verify.main(["--tp", "2", "--hidden", "48", "--heads", "3"]) == 2
    assert "n_heads=3 is not divisible by tp=2" in capsys.readouterr().err
    assert verify.main(["--tp", "2", "--sp", "--seq", "9"]) == 2
    assert "sequence length 9 is not divisible" in capsys.readouterr().err
    assert verify.main(["--tp", "1", "--sp"]) == 2
    assert "needs tp > 1" in capsys.readouterr().err


def test_unknown_option_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        verify.main(["--tensor", "2"])
    assert exit_.value.code == 2
    assert "unrecognized arguments: --tensor" in capsys.readouterr().err


def test_report_verdicts():
    ok = verify.Report([verify.Row(0, "loss", 1e-7, 1e-5), verify.Row(0, "logits", 2e-5, 1e-4)])
    assert ok.passed and ok.verdict() == "PASS max_rel_err=2.00e-05"
    bad = verify.Report([verify.Row(0, "loss", 1e-7, 1e-5), verify.Row(1, "dL/dX", float("nan"), 1e-4)])
    assert not bad.passed and bad.verdict().startswith("FAIL 1 of 2 comparisons; worst: step 1 dL/dX")


@pytest.mark.parametrize("option", ["--steps", "--batch"])
def test_steps_and_batch_must_be_positive(capsys, option):
    with pytest.raises(SystemExit) as exit_:
        verify.main([option, "0"])
    assert exit_.value.code == 2
    assert f"argument {option}: must be at least 1, got 0" in capsys.readouterr().err
