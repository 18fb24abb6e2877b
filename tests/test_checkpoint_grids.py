"""Checkpoints of every grid the engine runs, mixture-of-experts models included: saved at one
grid, loaded at another, the next step's loss is the same (tolerance as tests/test_checkpoint.py:
1e-5 relative, only the order of the sums differs)."""
import pytest

from minitron.grid import ParallelConfig
from minitron.config import ModelConfig
from minitron.train import checkpoint
from minitron.train.engine import TrainingRun
from minitron.verify import make_batch

TOL = 1e-5
DENSE = ModelConfig(vocab_size=64, seq_len=8, hidden=32, n_layers=4, n_heads=4, dropout=0.1)
MOE = ModelConfig(vocab_size=64, seq_len=8, hidden=32, n_layers=2, n_heads=4, dropout=0.1,
                  n_experts=4, topk=2)
BATCH = 8


def _run(mcfg, grid_kw, zero, seed):
    return TrainingRun(mcfg, ParallelConfig(**grid_kw), zero_stage=zero, microbatches=2, lr=1e-2,
                       seed=seed)


def _batch(step, mcfg):
    return make_batch(step, 11, BATCH, mcfg.seq_len, mcfg.vocab_size)


def save_then_step(mcfg, grid_kw, zero, path):
    run = _run(mcfg, grid_kw, zero, seed=0)
    for s in range(2):
        run.step(*_batch(s, mcfg), s)
    checkpoint.save(path, run.model, run.engine, run.optimizer, step=2)
    return run.step(*_batch(2, mcfg), 2)


def load_then_step(mcfg, grid_kw, zero, path):
    run = _run(mcfg, grid_kw, zero, seed=7)       # another seed: the load must replace it all
    before = run.evaluate(*_batch(0, mcfg))
    step = checkpoint.load(path, run.model, run.engine, run.optimizer)["step"]
    return before, run.evaluate(*_batch(0, mcfg)), run.step(*_batch(step, mcfg), step)


CASES = [   # (model, saved at, zero) -> loaded at [(grid, zero), ...]
    (MOE, dict(ep=2, dp=2), 1, [(dict(ep=4), 0), (dict(dp=4), 2)]),
    (MOE, dict(cp=2, ep=2), 0, [(dict(ep=2, dp=2), 1)]),
    (DENSE, dict(cp=2, dp=2), 1, [(dict(tp=2, dp=2), 0)]),
    (DENSE, dict(tp=2, pp=2), 0, [(dict(dp=4), 3)]),
    (DENSE, dict(dp=4, dp_shard=2), 3, [(dict(tp=2, dp=2), 1), (dict(dp=4, dp_shard=2, tp=1), 1)]),
]


@pytest.mark.parametrize("mcfg, saved, zero, loads", CASES,
                         ids=["moe-ep2dp2", "moe-cp2ep2", "cp2dp2", "tp2pp2-to-dp4-zero3", "hsdp-2x2-zero3"])
def test_a_checkpoint_loads_on_another_grid(run_ranks, tmp_path, mcfg, saved, zero, loads):
    path = str(tmp_path / "ckpt")
    next_loss = run_ranks(save_then_step, mcfg, saved, zero, path, world_size=4)[0]
    for grid_kw, load_zero in loads:
        before, after, loss = run_ranks(load_then_step, mcfg, grid_kw, load_zero, path,
                                        world_size=4)[0]
        assert abs(before - after) > 1e-3, "the load changed nothing (test of the test)"
        assert abs(loss - next_loss) <= TOL * abs(next_loss), (grid_kw, loss, next_loss)
