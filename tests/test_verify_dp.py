"""The verifier's data-parallel, ZeRO and 16-bit paths (minitron/verify/steps.py).

Each case runs verify's per-rank body (run_rank) on the test pool, tiny shapes, dropout on: every
dp rank takes its own rows of the global batch, and logits, loss, dL/dX, every reduced gradient
and every update must equal the reference on the whole batch (float32 tolerances; 16-bit ones,
checks.noise_rows, against a reference in the same precision with fp32 masters); replicas
bitwise over tp and dp. The two data-parallel plants must fail, by the rows that should see them.
"""
import pytest
import torch

from minitron.verify import cli as verify_cli
from minitron.grid import ParallelConfig
from minitron.model import ModelConfig
from minitron.pipeline.schedules import make_schedule
from minitron.verify.checks import update_tolerance
from minitron.verify import Report, run_rank

SMALL = dict(vocab_size=64, seq_len=8, hidden=32, n_layers=2, n_heads=4, dropout=0.1)
CASES = {
    # name: (ParallelConfig, zero, dtype, schedule (pp, microbatches) or None, batch)
    "dp2": (ParallelConfig(dp=2), None, torch.float32, None, 4),
    "dp2-tp2-sp": (ParallelConfig(dp=2, tp=2, sequence_parallel=True), None, torch.float32, None, 4),
    "dp2-pp2-1f1b": (ParallelConfig(dp=2, pp=2), None, torch.float32, (2, 4), 8),
    "dp4-zero3": (ParallelConfig(dp=4), 3, torch.float32, None, 4),
    "dp1-zero3": (ParallelConfig(dp=1), 3, torch.float32, None, 2),   # unsharded: params = shard
    "dp2-tp2-sp-zero1": (ParallelConfig(dp=2, tp=2, sequence_parallel=True), 1, torch.float32, None, 4),
    "dp2-zero2-bf16": (ParallelConfig(dp=2), 2, torch.bfloat16, None, 4),
    "tp2-sp-fp16": (ParallelConfig(tp=2, sequence_parallel=True), None, torch.float16, None, 2),
}


def _report(run_ranks, name, plant=None, steps=2, **model):
    pcfg, zero, dtype, pipe, batch = CASES[name]
    sched = make_schedule("1f1b", *pipe) if pipe else None
    mcfg = ModelConfig(**{**SMALL, **model})
    rows = run_ranks(run_rank, pcfg, mcfg, steps, dtype, 0, 1e-4, 1e-6, batch, None, plant, sched,
                     zero, world_size=pcfg.world_size)[0]
    return Report(rows)


@pytest.mark.parametrize("name", list(CASES))
def test_data_parallel_runs_match_the_reference(run_ranks, name):
    report = _report(run_ranks, name)
    assert report.passed, report.verdict() + "\n" + report.table()
    replicas = [r for r in report.rows if r.quantity.startswith("replicas")]
    assert replicas and all(r.err == 0.0 for r in replicas)
    dtype = CASES[name][2]
    if dtype != torch.float32:      # held to the twins' noise (checks.noise_rows), norm-wise and along
        grads = [r for r in report.rows if r.quantity.startswith("grad")]
        assert any(r.quantity.endswith(" along") for r in grads)
        assert all(0 < r.tol < 1 for r in grads if "attention.k.bias" not in r.quantity)
        assert max(r.err for r in grads) > torch.finfo(dtype).eps / 4
        masters = [r for r in report.rows if r.quantity.startswith("master")]
        assert masters and all(r.tol == update_tolerance() for r in masters)


def test_tied_embedding_across_stages_and_replicas(run_ranks):
    """dp2 x pp2 with tied embeddings: the two stages' copies are summed, then averaged over dp."""
    report = _report(run_ranks, "dp2-pp2-1f1b", steps=1, tie_embeddings=True)
    assert report.passed, report.verdict() + "\n" + report.table()


@pytest.mark.parametrize("name, plant, caught", [
    ("dp2", "dp-bucket", {"replicas grads"}),
    ("dp2-tp2-sp-zero1", "zero-gather", {"replicas weights"}),
])
def test_data_parallel_plants_fail(run_ranks, name, plant, caught):
    report = _report(run_ranks, name, plant=plant, steps=1)
    assert not report.passed
    failed = {r.quantity for r in report.failures}
    assert caught <= failed, report.table()
    kind = "grad" if plant == "dp-bucket" else "weight"      # the compared tensors fail too
    assert any(q.startswith(kind + " ") for q in failed), report.table()
    assert "differs between dp ranks 0 and 1" in report.verdict() or \
        any("dp ranks" in r.detail for r in report.failures)


@pytest.mark.parametrize("argv, message", [
    (["--dp", "2", "--batch", "3"], "cannot be cut into dp=2 replicas"),
    (["--dp", "2", "--dtype", "float64"], "steps float32 master weights"),
    (["--dtype", "float16", "--pp", "2"], "use --dtype bfloat16 or --pp 1"),
])
def test_bad_data_parallel_options_exit_2(capsys, argv, message):
    assert verify_cli.main(["--tp", "1", *argv]) == 2
    assert message in capsys.readouterr().err
