"""The balance loss's scope (ModelConfig.aux_loss_scope) on a loss curve, with micro-batches.

With "global" the per-expert counts of each micro-batch are summed over dp x ep x cp, so dp2 or
ep2 with 4 micro-batches trains exactly like one device whose 4 micro-batches hold the same rows:
replica d's micro-batch m is rows d*B/2 + m*B/8 ..., so the one device gets the batch's rows
reordered (`same_rows`; the language-model loss, a mean over rows, does not see the order).
One device given the rows in their plain order is *not* that run: its micro-batch m holds
other rows, and the balance loss is a product of sums over the micro-batch (f_e * P_e), not a
sum over rows, so no layout of the replicas could match it (measured below, not hidden).
"replica" counts each dp x ep replica's own tokens: the test of the test, its curve bends."""
import pytest
import torch

from minitron.config import ModelConfig
from minitron.grid import ParallelConfig
from minitron.train.engine import TrainingRun
from minitron.verify import make_batch

BATCH, MICRO, STEPS, TOL = 16, 4, 4, 1e-6
MODEL = dict(vocab_size=64, seq_len=8, hidden=32, n_layers=2, n_heads=4, dropout=0.0,
             n_experts=4, topk=2, aux_loss_coeff=0.1)


def same_rows(replicas: int) -> torch.Tensor:
    """The batch's rows in the order that gives one device's micro-batch m the rows the
    `replicas` replicas hold in their micro-batch m (train/step.py's replica_rows, then m)."""
    per = BATCH // replicas
    mb = per // MICRO
    return torch.tensor([d * per + m * mb + i
                         for m in range(MICRO) for d in range(replicas) for i in range(mb)])


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
    """One device, 4 micro-batches: the rows of 2 or 4 replicas' micro-batches, and the plain order."""
    return {"same": run_ranks(_curve, {}, "global", same_rows(2), world_size=1)[0],
            "same4": run_ranks(_curve, {}, "global", same_rows(4), world_size=1)[0],
            "plain": run_ranks(_curve, {}, "global", same_rows(1), world_size=1)[0]}


@pytest.mark.parametrize("parallel,same", [({"dp": 2}, "same"), ({"ep": 2}, "same"),
                                           ({"dp": 2, "ep": 2}, "same4")],
                         ids=["dp2", "ep2", "dp2xep2"])
def test_global_scope_gives_one_devices_curve(run_ranks, one_device, parallel, same):
    curves = run_ranks(_curve, parallel, "global", same_rows(1), world_size=2 * len(parallel))
    for rank, curve in enumerate(curves):
        assert _worst(curve, one_device[same]) < TOL, (parallel, rank, curve, one_device[same])


@pytest.mark.parametrize("parallel", [{"dp": 2}, {"ep": 2}], ids=["dp2", "ep2"])
def test_replica_scope_bends_the_curve(run_ranks, one_device, parallel):
    curve = run_ranks(_curve, parallel, "replica", same_rows(1), world_size=2)[0]
    assert _worst(curve, one_device["same"]) > 100 * TOL, (curve, one_device["same"])


def test_micro_batches_of_other_rows_are_another_objective(one_device):
    """What micro-batching itself changes: one device, same rows, other micro-batches."""
    assert _worst(one_device["plain"], one_device["same"]) > 100 * TOL, one_device
