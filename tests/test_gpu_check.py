"""make gpu-check (python -m minitron.bench gpu), checked on a CPU: the dry run names every part
and runs nothing, every command it would run parses with that command's own flags, the parts
fit the 8-minute budget, the train part's code path runs (a tiny model, eager), and the summary
reads the CSVs the parts write."""
import os
import subprocess

import pytest
import torch

from minitron.bench import cli, gpu, gpu_report, gpu_train
from minitron.bench import kernels as kernel_bench
from minitron.estimate.memory import rank_params

PARTS = ["kernels", "train", "verify", "verify --kernels", "tests"]


def test_the_dry_run_says_what_it_would_run_and_runs_nothing(monkeypatch, capsys):
    def refuse(*a, **k):
        raise AssertionError("the dry run started something")
    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(gpu, "gpu_name", lambda: None)          # as on this CPU machine
    monkeypatch.setattr(torch.cuda, "init", refuse)
    assert cli.main(["gpu", "--dry-run"]) == 0
    out = capsys.readouterr().out
    today = gpu.datetime.date.today().isoformat()
    for part in gpu.plan("GPU", today):
        assert f"{part.name} (at most {part.seconds} s)" in out and part.command() in out
    assert "MINITRON_BACKEND=nccl python -m minitron.verify --tp 1 --steps 2 --kernels" in out
    assert f"bench/results/kernels_GPU_{today}.csv" in out and f"gpu_check_GPU_{today}.csv" in out


def test_the_parts_fit_the_budget_with_room_for_start_up():
    parts = gpu.plan("NVIDIA H200", "2026-01-01")
    assert [p.name for p in parts] == PARTS
    assert sum(p.seconds for p in parts) <= gpu.BUDGET_S - 20 and gpu.BUDGET_S == 8 * 60
    assert parts[0].csv == "bench/results/kernels_NVIDIA-H200_2026-01-01.csv"


def test_every_command_it_would_run_takes_those_flags():
    verify_parser = __import__("minitron.verify.cli", fromlist=["_parser"])._parser()
    for part in gpu.plan("GPU", "2026-01-01"):
        module, args = part.argv[1], part.argv[2:]
        if module == "minitron.bench":
            (kernel_bench._parser() if args[0] == "kernels" else gpu.parser()).parse_args(args[1:])
        elif module == "minitron.verify":
            verify_parser.parse_args(args)
        else:
            assert module == "pytest" and all(os.path.exists(f) for f in gpu.GPU_TESTS)


def test_without_a_gpu_the_check_refuses_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(gpu, "gpu_name", lambda: None)
    assert cli.main(["gpu"]) == 1
    assert "needs a CUDA GPU, and this machine has none; --dry-run" in capsys.readouterr().err


def test_the_model_of_the_train_part_is_gpt2_medium_sized():
    assert 340e6 < rank_params(gpu_train.gpt_350m()) < 370e6


def test_the_train_part_has_the_planners_prediction_beside_it():
    cfg = gpu_train.gpt_350m()
    h100, h200 = (gpu_train.planner_step_s(cfg, 8, name) for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H200"))
    a100 = gpu_train.planner_step_s(cfg, 8, "NVIDIA A100-SXM4-80GB")
    assert 0 < h200 <= h100 < a100 < 1.0           # same peak, more HBM bandwidth; 3x the peak
    assert gpu_train.planner_step_s(cfg, 8, "NVIDIA GeForce RTX 4090") is None


def test_the_train_part_runs_on_a_cpu_rank_and_writes_its_csv(tmp_path):
    path = tmp_path / "train.csv"
    assert gpu.main(["--part", "train", "--smoke", "--variants", "eager", "--csv", str(path)]) == 0
    rows = gpu_report._read(str(path))
    assert [r["variant"] for r in rows] == ["eager"] and not rows[0]["error"]
    assert float(rows[0]["step_s"]) > 0 and 0 < float(rows[0]["loss"]) < 10
    assert gpu_report.train_headline(str(path)).startswith("0M params: eager ")


def _kernel_row(direction, ms, achieved):
    return {"kernel": "flash_attention", "direction": direction, "shape": "b2 s4096 hq32 hkv8 d128 causal",
            "ms_triton": ms, "achieved": achieved, "unit": "TFLOP/s", "ceiling": 800.0,
            "pct_of_ceiling": round(100 * achieved / 800, 1), "vs_eager": 1.5}


def test_attention_is_quoted_as_a_fraction_of_the_matmul_rate(tmp_path):
    fwd, bwd = _kernel_row("fwd", 4.0, 400.0), _kernel_row("bwd", 12.0, 200.0)
    path = str(tmp_path / "k.csv")
    gpu_report.write_csv(path, list(fwd), [fwd, bwd])
    f, b, both = gpu_report.attention_fraction(gpu_report._read(path))
    # fwd+bwd: (400*4 + 200*12) TFLOP/s*ms over 16 ms = 250 TFLOP/s, of 800
    assert (f, b, both) == (0.5, 0.25, 250 / 800)
    assert "fwd 50%, bwd 25%, fwd+bwd 31% of the matmul rate" in gpu_report.kernels_headline(path)


def test_the_summary_table_takes_each_parts_verdict():
    assert gpu_report.verdict_line("x\nPASS max_rel_err=1e-7 (margin 40)\n") == "PASS max_rel_err=1e-7 (margin 40)"
    assert gpu_report.verdict_line("....\n== 6 passed, 2 deselected in 30s ==\n") == "6 passed, 2 deselected in 30s"
    table = gpu_report.table([{"part": "verify", "status": "ok", "seconds": 12, "headline": "PASS"},
                              {"part": "tests", "status": "timed out after 70 s", "seconds": 70,
                               "headline": ""}])
    assert table.splitlines()[0].startswith("part   | status") and "timed out after 70 s" in table


@pytest.mark.parametrize("name, file", [("NVIDIA H200", "NVIDIA-H200"), ("NVIDIA A100-SXM4-80GB",
                                                                          "NVIDIA-A100-SXM4-80GB")])
def test_files_are_named_by_gpu(name, file):
    assert gpu.tag(name) == file


def test_each_part_runs_under_its_share_and_the_budget_stops_the_rest(monkeypatch, tmp_path, capsys):
    """The check's own loop, with stand-in parts: one passes, one outlives its share (killed,
    'timed out'), and the last finds the budget spent; the summary CSV and table say so."""
    parts = [gpu.Part("verify", "passes", ["-c", "print('PASS max_rel_err=1.0e-07')"], 5),
             gpu.Part("slow", "sleeps past its 3 s", ["-c", "import time; time.sleep(30)"], 3),
             gpu.Part("late", "never starts", ["-c", "print('ran')"], 5)]
    monkeypatch.setattr(gpu, "gpu_name", lambda: "NVIDIA H200")
    monkeypatch.setattr(gpu, "plan", lambda name, date: parts)
    monkeypatch.setattr(gpu, "RESULTS", str(tmp_path))
    assert gpu.run_check(budget_s=11.5, date="2026-01-01") == 1
    rows = gpu_report._read(str(tmp_path / "gpu_check_NVIDIA-H200_2026-01-01.csv"))
    assert [(r["part"], r["status"]) for r in rows] == [
        ("verify", "ok"), ("slow", "timed out after 3 s"), ("late", "not run: budget spent")]
    assert rows[0]["headline"] == "PASS max_rel_err=1.0e-07"
    assert capsys.readouterr().out.rstrip().endswith("late   | not run: budget spent |       0 |")
