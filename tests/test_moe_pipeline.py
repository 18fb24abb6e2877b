"""Experts inside pipeline stages, against one device: each MoE layer's all-to-all runs inside
its stage, and the routers' auxiliary losses of a stage that is not the last reach its backward
(pipeline/executor.carry_aux_loss). The reference runs the same micro-batches, since the
auxiliary losses are over each micro-batch (verify/steps.reference_step)."""
import contextlib

import pytest

from minitron.grid import ParallelConfig
from minitron.config import ModelConfig
from minitron.pipeline import executor
from minitron.pipeline.schedules import make_schedule
from minitron.verify import Report, run_rank
from minitron.verify.patching import patched

CFG = ModelConfig(vocab_size=128, seq_len=16, hidden=64, n_layers=4, n_heads=4, dropout=0.1,
                  n_experts=4, topk=2)


def _verify(grid_kw, schedule, carry=True, virtual=1):
    # the planted bug, in this rank while it runs (a pool's ranks outlive the test): earlier
    # stages drop their auxiliary losses
    dropped = patched(executor, "carry_aux_loss", lambda out, aux, scale: out)
    pcfg = ParallelConfig(**grid_kw, virtual_pp=virtual)
    with contextlib.nullcontext() if carry else dropped:
        return run_rank(pcfg, CFG, 2, batch=4 * grid_kw.get("dp", 1) * grid_kw.get("ep", 1),
                        schedule=make_schedule(schedule, pcfg.pp, 4, virtual), zero=None)


@pytest.mark.parametrize("grid_kw, schedule, virtual", [
    (dict(pp=2, ep=2), "1f1b", 1), (dict(pp=2, ep=2), "zb-h1", 1),
    (dict(pp=2, ep=2), "interleaved", 2), (dict(pp=2, ep=2, dp=2), "1f1b", 1),
], ids=["ep2-pp2-1f1b", "ep2-pp2-zbh1", "ep2-pp2-interleaved", "ep2-pp2-dp2"])
def test_experts_inside_pipeline_stages_match_one_device(run_ranks, grid_kw, schedule, virtual):
    world = 1
    for v in grid_kw.values():
        world *= v
    report = Report(run_ranks(_verify, grid_kw, schedule, True, virtual, world_size=world)[0])
    assert report.passed, report.verdict()


def test_dropping_the_earlier_stages_auxiliary_losses_fails(run_ranks):
    report = Report(run_ranks(_verify, dict(pp=2, ep=2), "1f1b", False, world_size=4)[0])
    assert not report.passed
    assert any("router" in r.quantity for r in report.failures), report.verdict()
