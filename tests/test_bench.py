"""The benchmarks: the overhead benchmark states its config, timings, ratio and verdict; the
kernels' benchmark checks every kernel it times against the eager op, and its error column
would catch a wrong kernel."""
import csv
import os
import subprocess
import sys
import textwrap

import pytest

from minitron import bench
from minitron.kernels import bench as kernels_bench, ops


def test_overhead_runs_and_reports(capsys):
    assert bench.main(["overhead", "--repeats", "1", "--warmup", "0", "--batch", "1"]) == 0
    out = capsys.readouterr().out
    for label in ("machine:", "config:  ModelConfig(", "reference GPT", "ParallelGPT, tp=1",
                  "ratio parallel/reference", "target <= 1.10: "):
        assert label in out


def test_unknown_command_shows_usage(capsys):
    assert bench.main(["nonsense"]) == 2
    assert "usage: python -m minitron.bench" in capsys.readouterr().err


def test_kernels_bench_without_a_gpu_says_so(capsys, monkeypatch):
    """Lesson 10 quotes this answer on machines with a GPU: it must be what the script prints."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")   # no GPU, or the interpreter: nothing to measure
    assert kernels_bench.run([]) == 0
    assert capsys.readouterr().out == kernels_bench.NOTHING_TO_MEASURE + "\n"


# Two kernels run in the same implementation's precision differ by at most both their errors
# against the exact result: tests/test_kernels.py's tolerances (bf16 1.6e-2, fp32 1e-5), twice.
MAX_REL_ERR = {"bfloat16": 3.2e-2, "float32": 2e-5}

SMOKE = """
    import os, sys
    import torch
    if torch.cuda.device_count() == 0:
        os.environ["TRITON_INTERPRET"] = "1"   # before triton is imported
    from minitron.kernels import bench, ops

    csv_path, planted = sys.argv[1], sys.argv[2] == "planted"
    if planted:   # the Triton path of rms_norm and of the AdamW step is wrong by 10%
        rms_norm, adamw = ops.rms_norm, ops.fused_adamw_step
        ops.rms_norm = lambda x, w, eps=1e-5: rms_norm(x, w * 1.1 if ops._triton_path(x) else w, eps)
        ops.fused_adamw_step = lambda p, g, *a, **k: adamw(p, g * 1.1 if ops._triton_path(p) else g,
                                                             *a, **k)
    sys.exit(bench.run(["--smoke", "--no-compile", "--quick", "--csv", csv_path]))
"""


def _smoke_rows(tmp_path, planted: bool) -> list[dict]:
    script, path = tmp_path / "smoke.py", tmp_path / f"{planted}.csv"
    script.write_text(textwrap.dedent(SMOKE))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(script), str(path), "planted" if planted else "-"],
                         capture_output=True, text=True, timeout=900, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    with open(path) as f:
        assert next(csv.reader(f)) == kernels_bench.FIELDS
    with open(path) as f:
        return list(csv.DictReader(f))


def _too_far(rows: list[dict]) -> list[str]:
    return sorted(f"{r['kernel']} {r['direction']}" for r in rows
                  if not float(r["max_rel_err"]) <= MAX_REL_ERR[r["dtype"]])   # NaN fails too


@pytest.mark.skipif(not ops._triton_importable(),
                    reason="could not import 'triton': the kernels' benchmark runs them")
def test_kernels_bench_smoke_checks_every_kernel(tmp_path):
    """The script end to end at tiny sizes (timings meaningless off a GPU); every row's error
    column within tolerance; a 10% error planted in two kernels shows in exactly their rows."""
    rows = _smoke_rows(tmp_path, planted=False)
    assert {r["kernel"] for r in rows} == {"flash_attention", "rms_norm", "layer_norm", "swiglu",
                                           "bias_gelu", "scaled_masked_softmax", "cross_entropy",
                                           "fused_adamw_step"}
    assert _too_far(rows) == []
    assert _too_far(_smoke_rows(tmp_path, planted=True)) == [
        "fused_adamw_step step", "rms_norm bwd", "rms_norm fwd"]
