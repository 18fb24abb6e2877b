"""The overhead benchmark runs and states its config, both timings, the ratio and the verdict."""
from minitron import bench


def test_overhead_runs_and_reports(capsys):
    assert bench.main(["overhead", "--repeats", "1", "--warmup", "0", "--batch", "1"]) == 0
    out = capsys.readouterr().out
    for label in ("machine:", "config:  ModelConfig(", "reference GPT", "ParallelGPT, tp=1",
                  "ratio parallel/reference", "target <= 1.10: "):
        assert label in out


def test_unknown_command_shows_usage(capsys):
    assert bench.main(["nonsense"]) == 2
    assert "usage: python -m minitron.bench" in capsys.readouterr().err
