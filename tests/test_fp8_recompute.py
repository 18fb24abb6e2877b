"""FP8 delayed scaling with full recomputation (model/recompute.py, fp8_linear.ScaleTape): the
rerun in backward casts with the first forward's scales, so every amax history records each use
once, exactly as without recomputation, and the run verifies against one device. A rerun that
takes new scales (the tape not replayed) records twice: caught."""
import torch

from minitron import verify
from minitron.grid import ParallelConfig
from minitron.model import ModelConfig
from minitron.tensor_parallel.fp8 import FP8Recipe
from minitron.tensor_parallel.fp8_linear import ScaleTape, named_fp8_states
from minitron.train.engine import TrainingRun
from minitron.verify import make_batch

MCFG = dict(vocab_size=64, seq_len=8, hidden=32, n_layers=2, n_heads=4, dropout=0.0)


def histories(recompute, replay=True):
    real = ScaleTape.replay
    if not replay:                   # a planted bug: the rerun takes (and records) new scales
        ScaleTape.replay = ScaleTape.recording
    try:
        mcfg = ModelConfig(**MCFG, recompute=recompute)
        run = TrainingRun(mcfg, ParallelConfig(), dtype=torch.bfloat16, fp8=FP8Recipe("delayed"), seed=0)
        for step in range(2):
            run.step(*make_batch(step, 0, 2, mcfg.seq_len, mcfg.vocab_size), step)
    finally:                         # pool ranks outlive a test: undo the plant
        ScaleTape.replay = real
    return {f"{n}.{k}": (s.uses, s.history.clone()) for n, st in named_fp8_states(run.model).items()
            for k, s in zip(("input", "weight", "grad"), st.scalers())}


def _equal(a, b):
    return a.keys() == b.keys() and all(a[k][0] == b[k][0] and torch.equal(a[k][1], b[k][1]) for k in a)


def test_recomputation_records_every_amax_once(run_ranks):
    plain = run_ranks(histories, "none", world_size=1)[0]
    assert _equal(run_ranks(histories, "full", world_size=1)[0], plain)


def test_a_rerun_with_new_scales_is_caught(run_ranks):
    plain = run_ranks(histories, "none", world_size=1)[0]
    planted = run_ranks(histories, "full", False, world_size=1)[0]
    assert not _equal(planted, plain)
    assert _equal(run_ranks(histories, "full", world_size=1)[0], plain)   # undone in the rank


def test_fp8_delayed_with_full_recomputation_matches_one_device():
    mcfg = ModelConfig(**{**MCFG, "dropout": 0.1}, recompute="full")
    report = verify.verify(ParallelConfig(tp=2, sequence_parallel=True), mcfg, steps=2,
                           dtype=torch.bfloat16, fp8=FP8Recipe("delayed"))
    assert report.passed, report.verdict()
