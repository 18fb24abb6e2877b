"""ParallelGPT under context parallelism against the reference GPT, through minitron.verify.

Each case runs the verifier's per-rank body (verify.run_rank) on the test pool: the batch's
sequences cut into zigzag chunks over cp, the loss averaged over cp, logits and dL/dX gathered
back in order, every gradient (averaged over cp by finalize_grads) and every AdamW update
compared with the single-device reference at the verifier's float32 tolerances, replicas over
cp bitwise. Dropout is on (0.1): the masks are the reference's at the tokens' global positions.
The two context-parallel plants must fail.
"""
import pytest

from minitron.grid import ParallelConfig
from minitron.model import ModelConfig
from minitron.verify import run_rank
from minitron.verify.checks import Report

BASE = dict(vocab_size=64, seq_len=16, hidden=32, n_layers=2, n_heads=4, dropout=0.1)
LLAMA = dict(norm="rmsnorm", activation="swiglu", position="rope", bias=False, n_kv_heads=2,
             tie_embeddings=True)
CASES = {
    # name: (tp, cp, sp, variant, model options)
    "cp2-ring": (1, 2, False, "ring", {}),
    "cp4-ring-llama": (1, 4, False, "ring", LLAMA),
    "tp2-sp-cp2-ring": (2, 2, True, "ring", {}),
    "cp2-allgather-llama": (1, 2, False, "allgather", LLAMA),
    "cp2-ulysses": (1, 2, False, "ulysses", {}),
    "tp2-sp-cp2-ulysses-llama": (2, 2, True, "ulysses", dict(LLAMA, n_kv_heads=4)),
}
# with data parallelism: (dp, ZeRO stage); the engine averages gradients over dense_dp = dp x cp
DP_CASES = {"cp2-dp2-ring": (2, 0), "cp2-dp2-zero3-ring": (2, 3)}


def _report(run_ranks, name, plant=None, steps=2):
    tp, cp, sp, variant, opts = CASES[name]
    pcfg = ParallelConfig(tp=tp, cp=cp, sequence_parallel=sp, cp_variant=variant)
    mcfg = ModelConfig(**{**BASE, **opts})
    rows = run_ranks(run_rank, pcfg, mcfg, steps, plant=plant, world_size=pcfg.world_size)[0]
    return Report(rows)


@pytest.mark.parametrize("name", sorted(CASES))
def test_context_parallel_model_matches_reference(run_ranks, name):
    report = _report(run_ranks, name)
    assert report.passed, report.verdict() + "\n" + report.table()


@pytest.mark.parametrize("name", sorted(DP_CASES))
def test_context_parallel_with_data_parallel_matches_reference(run_ranks, name):
    """The batch's rows split over dp, each row's sequence over cp: rows gathered back over dp
    after the sequence over cp; the gradients averaged once, over dense_dp."""
    dp, zero = DP_CASES[name]
    pcfg = ParallelConfig(cp=2, dp=dp)
    rows = run_ranks(run_rank, pcfg, ModelConfig(**BASE), 2, batch=2 * dp, zero=zero,
                     world_size=pcfg.world_size)[0]
    report = Report(rows)
    assert report.passed, report.verdict() + "\n" + report.table()


@pytest.mark.parametrize("plant, caught", [("cp-no-rescale", "attention"),
                                           ("cp-chunk-order", "dL/dX")])
def test_context_parallel_plants_fail(run_ranks, plant, caught):
    """A merge without rescaling, or the batch cut in the wrong chunk order, is caught."""
    report = _report(run_ranks, "cp2-ring", plant=plant, steps=1)
    assert not report.passed
    assert any(caught in r.quantity for r in report.failures), report.verdict()
