"""ZeRO-3 with tied embeddings across pipeline stages (data_parallel/zero3.py): the first stage's
word embedding and the last stage's copy are each a unit of their own, the same layout on both, and
their gradient shards are summed over grid.embedding. Checked against one device (verify), the
two copies bitwise equal after each step, the sum's bytes 1/N of DataParallel's full-gradient sum,
and a run without that sum caught."""
import pytest
import torch

from minitron import verify
from minitron.data_parallel import gathered_params
from minitron.grid import ParallelConfig
from minitron.model import ModelConfig
from minitron.runtime import comm
from minitron.train.engine import TrainingRun
from minitron.verify import make_batch

TIED = ModelConfig(vocab_size=64, seq_len=8, hidden=32, n_layers=2, n_heads=4, dropout=0.1,
                   tie_embeddings=True)
PCFG = ParallelConfig(pp=2, dp=2)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_zero3_tied_across_stages_matches_one_device(schedule):
    report = verify.verify(PCFG, TIED, steps=2, zero=3, schedule=schedule, microbatches=4)
    assert report.passed, report.verdict()
    assert any(r.quantity == "grad embedding.word.weight" for r in report.rows)


def tied_rank(zero, sum_copies=True):
    run = TrainingRun(TIED, PCFG, zero_stage=zero, microbatches=2, schedule="1f1b", lr=1e-2)
    if not sum_copies:               # a planted bug: the two copies' gradients never summed
        run.engine.tied = []
    with comm.counting() as c:
        for step in range(2):
            run.step(*make_batch(step, 0, 4, TIED.seq_len, TIED.vocab_size), step)
    weights = gathered_params(run.engine) if zero == 3 else dict(run.model.named_parameters())
    word = weights.get("embedding.word.weight")
    return (None if word is None else word.detach().clone(), c.wire_bytes(group="embedding"),
            run.grid.is_first_stage)


def _copies(results):
    return [w for w, _, _ in results if w is not None]


def test_both_copies_take_the_same_step_and_the_sum_sends_a_shard(run_ranks):
    zero3 = run_ranks(tied_rank, 3, world_size=4)
    ddp = run_ranks(tied_rank, 1, world_size=4)
    first, last = _copies(zero3)[0], _copies(zero3)[-1]
    assert torch.equal(first, last)                            # the copies stay one weight
    assert torch.allclose(first, _copies(ddp)[0], rtol=1e-5, atol=1e-7)   # ZeRO-1's weight
    v_h = TIED.vocab_size * TIED.hidden
    for (_, wire, _), (_, ddp_wire, _) in zip(zero3, ddp):     # every rank holds a copy here
        assert ddp_wire == 2 * v_h * 4                          # ZeRO-1: the whole gradient, 2 steps
        assert wire == 2 * v_h * 4 / PCFG.dp                    # ZeRO-3: this rank's shard only


def test_copies_whose_gradients_are_not_summed_drift_apart(run_ranks):
    copies = _copies(run_ranks(tied_rank, 3, False, world_size=4))
    assert not torch.equal(copies[0], copies[-1])
