"""16-bit experts inside pipeline stages (verify/routing.py MicroBatchRouting): the routers run
micro-batch by micro-batch on both sides, their choices are compared row for row, and with
--reference-routing the split model takes the reference's choices for exactly the rows each
micro-batch holds. Seed 1 has one rounding flip of a top-k at step 1 (bfloat16, pp 2 x ep 2): it is
counted without the flag and, with it (the default in 16 bits), judged a near tie; imposing another micro-batch's choices fails."""
import torch

from minitron import verify
from minitron.grid import ParallelConfig
from minitron.model import ModelConfig
from minitron.verify import routing

PCFG = ParallelConfig(pp=2, ep=2)
MOE = ModelConfig(vocab_size=128, seq_len=16, hidden=64, n_layers=2, n_heads=4, dropout=0.1,
                  n_experts=4, topk=2, z_loss_coeff=1e-3)      # the command line's defaults


def _run(**kw):
    return verify.verify(PCFG, MOE, steps=2, dtype=torch.bfloat16, seed=1, **kw)


def _routing(report):
    return [r for r in report.rows if r.quantity.startswith("moe routing")]


def test_a_flip_is_counted_micro_batch_by_micro_batch():
    report = _run(reference_routing=False)
    assert [r.err for r in _routing(report)] == [0.0, 1.0]          # 1 of 512 choices, step 1
    assert {r.step for r in report.failures} == {1}, report.table()  # and what follows from it


def test_the_reference_choices_taken_per_micro_batch_pass():
    report = _run()           # the default in 16 bits: the reference's choices taken
    assert report.passed, report.verdict()
    assert _routing(report)[1].quantity.endswith("own top-k differs in 1 of 512, 1 near ties)")


def test_another_micro_batchs_choices_imposed_are_caught(monkeypatch):
    start = routing.MicroBatchRouting.start

    def shifted(self, shape, imposed):      # a planted bug: each row gets the next row's choices
        start(self, shape, None if imposed is None else [c.roll(1, dims=0) for c in imposed])
    monkeypatch.setattr(routing.MicroBatchRouting, "start", shifted)
    report = _run(reference_routing=True)
    assert not report.passed
    assert all(r.err > 0 for r in _routing(report))
