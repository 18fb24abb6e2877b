"""Training-level check: the same seed and the same tokens give the same loss curve on every
tensor-parallel configuration (torchtitan's habit). Each configuration trains on its own
for several AdamW steps, with no reference alongside; only the curves are compared."""
import pytest
import torch

from minitron.grid import ParallelConfig, build_grid
from minitron.config import ModelConfig
from minitron.model.parallel import ParallelGPT
from minitron.train.step import parallel_step
from minitron.verify import make_batch

STEPS = 8
MODEL = ModelConfig(vocab_size=64, seq_len=8, hidden=32, n_layers=2, n_heads=4, dropout=0.1)


def _train(tp: int, sp: bool, plant_bug: bool = False) -> list[float]:
    grid = build_grid(ParallelConfig(tp=tp, sequence_parallel=sp))
    model = ParallelGPT(MODEL, grid, seed=3)
    if plant_bug:   # forget to sum the sequence-parallel gradients of the norms
        model.finalize_grads = lambda: None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    losses = []
    for step in range(STEPS):   # two batches in turn: random tokens, but memorisable
        tokens, targets = make_batch(step % 2, 3, 4, MODEL.seq_len, MODEL.vocab_size)
        opt.zero_grad()
        _, _, loss = parallel_step(model, tokens, targets, step_seed=step)
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def baseline(run_ranks):
    return run_ranks(_train, 1, False, world_size=1)[0]


def test_the_model_learns(baseline):
    assert baseline[-1] < baseline[0] - 0.1, baseline   # a curve worth comparing


@pytest.mark.parametrize("tp,sp", [(2, False), (2, True), (4, True)])
def test_same_loss_curve_at_every_split(run_ranks, baseline, tp, sp):
    curves = run_ranks(_train, tp, sp, world_size=tp)
    for rank, curve in enumerate(curves):
        worst = max(abs(a - b) / abs(b) for a, b in zip(curve, baseline))
        assert worst < 1e-5, f"tp={tp} sp={sp} rank {rank}: curve differs by {worst:.1e}"


def test_a_planted_bug_bends_the_curve(run_ranks, baseline):
    curve = run_ranks(_train, 2, True, True, world_size=2)[0]
    worst = max(abs(a - b) / abs(b) for a, b in zip(curve, baseline))
    assert worst > 1e-3, f"a missing gradient sum went unnoticed ({worst:.1e})"
