"""The balance loss's scope (ModelConfig.aux_loss_scope) on a loss curve, with micro-batches.

With "global" the per-expert counts of each micro-batch are summed over dp x ep x cp, and the
step's micro-batch m holds the same rows on every layout (train/step.py replica_rows, Megatron's
sampler: rows [m*B/M, (m+1)*B/M), each replica one slice of them), so dp2, ep2 or dp2 x ep2 with
4 micro-batches trains exactly like one device with 4 micro-batches, batch for batch.
The test of the test, twice: one device given the same rows in another order is *not* that run
(its micro-batches hold other rows, and the balance loss is a product of sums over the
micro-batch, f_e * P_e, not a sum over rows: the language-model loss alone would not see it);
and "replica", which counts each dp x ep replica's own tokens, bends the curve."""
import pytest
import torch

from minitron.config import ModelConfig
from minitron.grid import ParallelConfig
from minitron.train.engine import TrainingRun
from minitron.verify import make_batch

BATCH, MICRO, STEPS, TOL = 16, 4, 4, 1e-6
MODEL = dict(vocab_size=64, seq_len=8, hidden=32, n_layers=2, n_heads=4, dropout=0.1,
             n_experts=4, topk=2, aux_loss_coeff=0.1)


def other_micro_batches() -> torch.Tensor:
    """The batch's rows dealt to the micro-batches another way: micro-batch m gets rows
    m*B/8 + [0, B/8) and B/2 + m*B/8 + [0, B/8) (the halves' m-th quarters)."""
    half, mb = BATCH // 2, BATCH // 8
    return torch.tensor([h * half + m * mb + i for m in range(MICRO) for h in range(2)
                         for i in range(mb)])


PLAIN = torch.arange(BATCH)


def _curve(parallel: dict, scope: str, order: torch.Tensor) -> list[float]:
    cfg = ModelConfig(**MODEL, aux_loss_scope=scope)
    run = TrainingRun(cfg, ParallelConfig(**parallel), microbatches=MICRO, zero_stage=0,
                      seed=1, lr=1e-2)
    losses = []
    for step in range(STEPS):      # two batches in turn, as tests/test_loss_curve.py
        tokens, targets = make_batch(step % 2, 5, BATCH, cfg.seq_len, cfg.vocab_size)
        losses.append(run.step(tokens[order], targets[order], step))
    return losses


def _worst(a, b):
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def one_device(run_ranks):
    """One device, 4 micro-batches: the batch in its order, and dealt to the micro-batches otherwise."""
    return {"plain": run_ranks(_curve, {}, "global", PLAIN, world_size=1)[0],
            "other": run_ranks(_curve, {}, "global", other_micro_batches(), world_size=1)[0]}


@pytest.mark.parametrize("parallel", [{"dp": 2}, {"ep": 2}, {"dp": 2, "ep": 2}, {"dp": 2, "pp": 2}],
                         ids=["dp2", "ep2", "dp2xep2", "dp2xpp2"])   # pp: the schedule's 4 micro-batches
def test_global_scope_gives_one_devices_curve(run_ranks, one_device, parallel):
    curves = run_ranks(_curve, parallel, "global", PLAIN, world_size=2 * len(parallel))
    for rank, curve in enumerate(curves):
        assert _worst(curve, one_device["plain"]) < TOL, (parallel, rank, curve, one_device["plain"])


@pytest.mark.parametrize("parallel", [{"dp": 2}, {"ep": 2}], ids=["dp2", "ep2"])
def test_replica_scope_bends_the_curve(run_ranks, one_device, parallel):
    curve = run_ranks(_curve, parallel, "replica", PLAIN, world_size=2)[0]
    assert _worst(curve, one_device["plain"]) > 100 * TOL, (curve, one_device["plain"])


def test_micro_batches_of_other_rows_are_another_objective(one_device):
    """What the composition of the micro-batches changes: one device, the same rows, dealt otherwise."""
    assert _worst(one_device["other"], one_device["plain"]) > 100 * TOL, one_device
