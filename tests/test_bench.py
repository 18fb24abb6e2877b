"""The benchmarks: the overhead benchmark states its config, timings, and a ratio and verdict for
every path (ParallelGPT, the pipeline executor, data parallel and ZeRO at size one); the overlap
benchmark draws its timeline and prints the hidden share and what limits it; the kernels'
benchmark checks every kernel it times against the eager op, and its error column would catch a
wrong kernel. Smoke tests at tiny shapes: no timing is asserted."""
import csv
import os
import re
import subprocess
import sys
import textwrap

import pytest

from minitron.bench import cli as bench_cli, overhead as bench, overlap as bench_overlap
from minitron.bench import kernels as kernels_bench
from minitron.kernels import ops
from minitron.config import ModelConfig

TINY = ModelConfig(vocab_size=64, seq_len=8, hidden=32, n_layers=2, n_heads=4, dropout=0.1)
PATHS = {"ParallelGPT, tp=1": "1.05", "pipeline pp=1, 1f1b m=1": "1.05",
         "data parallel dp=1": "1.05", "ZeRO-1 dp=1": "1.05", "ZeRO-3 dp=1": "1.05",
         "context parallel cp=1": "1.05", "ParallelGPT MoE, ep=1": "1.05"}


def test_overhead_runs_and_reports(capsys, monkeypatch):
    monkeypatch.setattr(bench, "OVERHEAD_CONFIG", TINY)
    assert bench_cli.main(["overhead", "--repeats", "2", "--warmup", "0", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    for label in ("machine:", "config:  ModelConfig(vocab_size=64,", "reference GPT", "wall ms",
                  "cpu ms", "ratio to reference"):
        assert label in out
    lines = out.splitlines()
    for path, target in PATHS.items():
        row = [line for line in lines if line.startswith(path)]
        assert len(row) == 1, (path, out)
        assert re.search(rf"\d+\.\d{{3}}   \(target <= {target}: (met|NOT met)\)", row[0]), row[0]
    ring = next(line for line in lines if line.startswith("ring forced on at cp=1"))
    assert re.search(r"\d+\.\d{3}$", ring), ring        # a ratio, no target: see bench's docstring
    moe = next(line for line in lines if line.startswith("ParallelGPT MoE"))
    assert moe.endswith("vs MoE reference GPT"), moe     # against its own reference


def _forced_ring_rank(forced: bool, plant: bool):
    from minitron.grid import ParallelConfig, build_grid
    from minitron.model.parallel import ParallelGPT
    from minitron.model.reference import GPT
    from minitron.train.step import parallel_step
    from minitron.verify import make_batch
    grid = build_grid(ParallelConfig(tp=1))
    model = ParallelGPT.from_reference(GPT(TINY, seed=0), grid)
    model.ctx.context_parallel = forced
    from minitron.context_parallel.blocks import Accumulator
    merge = Accumulator.merge
    if plant:   # a 1% error in every block the ring merges (at cp=1: one causal block)
        Accumulator.merge = lambda self, rows, out_b, lse_b: merge(self, rows, 1.01 * out_b, lse_b)
    try:
        tokens, targets = make_batch(0, 0, 2, TINY.seq_len, TINY.vocab_size)
        _, _, loss = parallel_step(model, tokens, targets, step_seed=3)
    finally:
        Accumulator.merge = merge
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("plant", [False, True])
def test_the_forced_ring_row_computes_the_plain_path(run_ranks, plant):
    """The 'context parallel cp=1, ring' row times a correct computation: with the ring forced
    on at cp=1 (dropout 0.1 included) loss and every gradient equal the plain path's, to 1e-5;
    a planted 1% error in the ring's merged blocks is caught."""
    import torch
    plain_loss, plain_grads = run_ranks(_forced_ring_rank, False, False, world_size=1)[0]
    loss, grads = run_ranks(_forced_ring_rank, True, plant, world_size=1)[0]
    same = torch.allclose(loss, plain_loss, rtol=1e-5, atol=0) and all(
        torch.allclose(grads[n], g, rtol=1e-5, atol=1e-7) for n, g in plain_grads.items())
    assert same != plant


def test_paired_ratio_cancels_a_slow_spell():
    """Round 2 ran while the machine was twice as slow for both: the ratio does not move."""
    assert bench.paired_ratio([1.05, 2.10, 1.05], [1.0, 2.0, 1.0]) == pytest.approx(1.05)


def test_overlap_figures_from_a_timeline():
    """backward 0-10 s; bucket 0 all-reduce 2-4 (inside), bucket 1 9-12 (1 s of 3 inside);
    finish_grad_sync returns at 12.5: 3 of 5 s hidden, 2.5 s exposed."""
    step = {"backward": (0.0, 10.0), "done": 12.5, "comm": [(0, 2.0, 4.0), (1, 9.0, 12.0)]}
    figures = bench_overlap.summarize(step)
    assert figures == pytest.approx({"backward": 10.0, "comm": 5.0, "inside": 3.0,
                                        "hidden": 0.6, "exposed": 2.5})
    lines = bench_overlap.timeline(step, width=25)
    assert [line.split("|")[0].strip() for line in lines] == [
        "backward", "bucket 0 all-reduce", "bucket 1 all-reduce", "waiting after bwd"]
    assert lines[1].split("|")[1] == " " * 4 + "#" * 4 + " " * 17   # 2-4 s of 12.5, 25 columns


def test_overlap_runs_and_reports(capsys, monkeypatch):
    monkeypatch.setattr(bench, "OVERHEAD_CONFIG", TINY)
    assert bench_cli.main(["overlap", "--repeats", "1", "--buckets", "2", "--batch", "4"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"all-reduce time hidden behind backward +\d+\.\d%   \(aim >= 80%: (met|NOT met); "
                     r"the steps ranged \d+-\d+%\)",
                     out), out
    for label in ("machine:", "dp=2 on gloo", "backward            |", "bucket 0 all-reduce |",
                  "bucket 1 all-reduce |", "timeline: ", "by cost: ", "without (no_sync)",
                  "what limits it on gloo:"):
        assert label in out, (label, out)


def test_unknown_command_shows_usage(capsys):
    assert bench_cli.main(["nonsense"]) == 2
    assert "usage: python -m minitron.bench" in capsys.readouterr().err


def test_kernels_bench_without_a_gpu_says_so(capsys, monkeypatch):
    """Lesson 10 quotes this answer on machines with a GPU: it must be what the script prints."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")   # no GPU, or the interpreter: nothing to measure
    assert kernels_bench.run([]) == 0
    assert capsys.readouterr().out == kernels_bench.NOTHING_TO_MEASURE + "\n"


# Two kernels run in the same implementation's precision differ by at most both their errors
# against the exact result: tests/test_kernels.py's tolerances (bf16 1.6e-2, fp32 1e-5), twice.
MAX_REL_ERR = {"bfloat16": 3.2e-2, "float32": 2e-5}

# One process for both runs (the clean, then the planted): an interpreter, torch and Triton's
# interpreter started once, not twice (the test: 21 s -> 12 s, 2 loaded cores, --durations). The plant goes in
# after the clean run, and bench.run builds its cases anew, so the planted run takes it.
SMOKE = """
    import os, sys
    import torch
    if torch.cuda.device_count() == 0:
        os.environ["TRITON_INTERPRET"] = "1"   # before triton is imported
    from minitron.bench import kernels as bench
    from minitron.kernels import ops

    clean_csv, planted_csv = sys.argv[1], sys.argv[2]
    if bench.run(["--smoke", "--no-compile", "--quick", "--csv", clean_csv]) != 0:
        sys.exit("the clean run failed")
    # the planted run: the Triton path of rms_norm and of the AdamW step is wrong by 10%
    rms_norm, adamw = ops.rms_norm, ops.fused_adamw_step
    ops.rms_norm = lambda x, w, eps=1e-5: rms_norm(x, w * 1.1 if ops._triton_path(x) else w, eps)
    ops.fused_adamw_step = lambda p, g, *a, **k: adamw(p, g * 1.1 if ops._triton_path(p) else g,
                                                         *a, **k)
    sys.exit(bench.run(["--smoke", "--no-compile", "--quick", "--csv", planted_csv]))
"""


def _smoke_rows(tmp_path) -> tuple[list[dict], list[dict]]:
    """The clean run's rows and the planted run's."""
    script, paths = tmp_path / "smoke.py", [tmp_path / "clean.csv", tmp_path / "planted.csv"]
    script.write_text(textwrap.dedent(SMOKE))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(script), *map(str, paths)],
                         capture_output=True, text=True, timeout=900, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = []
    for path in paths:
        with open(path) as f:
            assert next(csv.reader(f)) == kernels_bench.FIELDS
        with open(path) as f:
            out.append(list(csv.DictReader(f)))
    return out[0], out[1]


def _too_far(rows: list[dict]) -> list[str]:
    return sorted(f"{r['kernel']} {r['direction']}" for r in rows
                  if not float(r["max_rel_err"]) <= MAX_REL_ERR[r["dtype"]])   # NaN fails too


@pytest.mark.skipif(not ops._triton_importable(),
                    reason="could not import 'triton': the kernels' benchmark runs them")
def test_kernels_bench_smoke_checks_every_kernel(tmp_path):
    """The script end to end at tiny sizes (timings meaningless off a GPU); every row's error
    column within tolerance; a 10% error planted in two kernels shows in exactly their rows."""
    rows, planted = _smoke_rows(tmp_path)
    assert {r["kernel"] for r in rows} == {"flash_attention", "rms_norm", "layer_norm", "swiglu",
                                           "bias_gelu", "scaled_masked_softmax", "cross_entropy",
                                           "fused_adamw_step"}
    assert _too_far(rows) == []
    assert _too_far(planted) == [
        "fused_adamw_step step", "rms_norm bwd", "rms_norm fwd"]
