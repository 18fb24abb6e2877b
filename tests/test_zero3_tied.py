"""ZeRO-3 with tied embeddings (data_parallel/zero3.py): the word embedding has one owner, the
embedding unit, held gathered from the lookup's forward to its reduce-scatter, which sends the sum
of both uses' gradients. Checked against the reference (gradients and updates, 2 micro-batches),
traffic counted exactly, and the refusal that remains (V schedules; across pipeline ranks:
tests/test_zero3_tied_pipeline.py)."""
import pytest

from minitron.data_parallel import ZeroStage3
from minitron.train.step import forward_backward
from minitron.grid import ParallelConfig, build_grid
from minitron.model import ModelConfig, ParallelGPT
from minitron.runtime import comm
from minitron.verify import cli as verify_cli
from minitron.verify import make_batch
from test_data_parallel import BASE, SEED, _failures, dp_rank

TIED = dict(BASE, tie_embeddings=True)


@pytest.mark.parametrize("pcfg, world", [(ParallelConfig(dp=2), 2),
                                         (ParallelConfig(dp=2, tp=2, sequence_parallel=True), 4)])
def test_zero3_tied_matches_reference(run_ranks, pcfg, world):
    # 2 steps, 2 micro-batches, global batch 8: every gradient and update against the reference
    rows, _ = run_ranks(dp_rank, pcfg, ModelConfig(**TIED, dropout=0.1), 3, 2, 2, 8, 4096,
                        world_size=world)[0]
    assert not _failures(rows), "\n".join(_failures(rows))
    assert any(r.quantity == "grad embedding.word.weight" for r in rows), [r.quantity for r in rows]


def traffic_rank(micro):
    grid = build_grid(ParallelConfig(dp=2))
    mcfg = ModelConfig(**TIED)
    model = ParallelGPT(mcfg, grid, seed=SEED)
    engine = ZeroStage3(model, grid)
    tokens, targets = make_batch(0, SEED, 4, mcfg.seq_len, mcfg.vocab_size)
    engine.zero_grad()
    with comm.counting() as c:
        forward_backward(model, None, tokens, targets, 0, engine=engine, microbatches=micro)
        engine.finish_grad_sync()
    embedding = sum(p.numel() for p in model.embedding.parameters())
    psi = sum(p.numel() for p in model.parameters())
    gathered_after = sum(u.gathered for u in engine.units)
    return (c.calls("all_gather"), c.calls("reduce_scatter"), c.wire_bytes(group="dense_dp"),
            len(engine.units), embedding, psi, gathered_after)


@pytest.mark.parametrize("micro", [1, 2])
def test_the_tied_unit_is_gathered_once_per_microbatch(run_ranks, micro):
    gathers, scatters, wire, units, emb, psi, after = run_ranks(traffic_rank, micro, world_size=2)[0]
    # every other unit: forward and backward; the held embedding unit once; grads once each
    assert gathers == micro * (2 * units - 1) and scatters == micro * units and after == 0
    assert wire == micro * (3 * psi - emb) * (2 - 1) / 2 * 4        # float32, N = 2


@pytest.mark.parametrize("argv, message", [
    (["--tp", "1", "--dp", "2", "--pp", "2", "--zero", "3", "--tie", "--schedule", "zb-v",
      "--layers", "4", "--microbatches", "4"], "the one tied weight's two uses"),
])
def test_zero3_tied_in_pipelines_is_refused(capsys, argv, message):
    assert verify_cli.main(argv) == 2
    assert message in capsys.readouterr().err
