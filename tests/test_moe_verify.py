"""python -m minitron.verify with experts: the MoE GPT split over ep (with tp+SP, with dp)
against the single-device GPT: logits, loss with the routers' auxiliary losses, dL/dX, every
gradient and update at verify's float32 bars, and the dropped (token, expert) pairs bitwise.
Planted dispatch bugs (a wrong split size, an unpermute off by one) fail; bad options exit 2."""
import pytest

from minitron.verify import cli as verify_cli
from minitron.grid import ParallelConfig
from minitron.model import ModelConfig
from minitron.verify import Report, run_rank

SMALL = dict(vocab_size=64, seq_len=8, hidden=32, n_layers=2, n_heads=4, dropout=0.1)
CASES = {
    # name: (ParallelConfig, model options, batch)
    "ep2-top2": (ParallelConfig(ep=2), dict(n_experts=4, topk=2, z_loss_coeff=1e-3), 2),
    "ep2-tp2-sp-swiglu-every-2": (ParallelConfig(ep=2, tp=2, sequence_parallel=True),
                                  dict(n_experts=4, moe_every=2, norm="rmsnorm", activation="swiglu",
                                       position="rope", bias=False), 2),
    "ep4-capacity": (ParallelConfig(ep=4), dict(n_experts=8, capacity_factor=1.0), 4),
    "ep2-dp2": (ParallelConfig(ep=2, dp=2), dict(n_experts=4), 4),
}


def _run(run_ranks, name, plant=None, steps=2):
    pcfg, opts, batch = CASES[name]
    return Report(run_ranks(run_rank, pcfg, ModelConfig(**{**SMALL, **opts}), steps, batch=batch,
                            plant=plant, world_size=pcfg.world_size)[0])


@pytest.mark.parametrize("name", list(CASES))
def test_expert_parallel_split_passes_with_margin(run_ranks, name):
    report = _run(run_ranks, name)
    assert report.passed, report.table()
    worst = report.worst(report.rows)
    assert worst.err <= worst.tol / 4, report.table()
    drops = [r.quantity for r in report.rows if r.quantity.startswith("moe drops")]
    assert len(drops) == 2 and ("(0 pairs" in drops[0]) == (name != "ep4-capacity"), drops
    assert any(r.quantity == "grad layers.*.mlp.experts.fc1.weight" for r in report.rows)


@pytest.mark.parametrize("plant", ["moe-split", "moe-unpermute"])
def test_planted_dispatch_bug_fails(run_ranks, plant):
    report = _run(run_ranks, "ep2-top2", plant=plant, steps=1)
    assert not report.passed
    assert any(r.quantity.startswith("grad layers.*.mlp.experts") for r in report.failures)


@pytest.mark.parametrize("argv,message", [
    (["--ep", "2"], "a dense model has none"),
    (["--ep", "2", "--tp", "2", "--experts", "4"], "without SP every tp rank holds every token"),
    (["--ep", "2", "--experts", "4", "--batch", "3"], "use a multiple of 2"),
    (["--ep", "2", "--experts", "4", "--pp", "2", "--capacity-factor", "1"], "micro-batch by micro-batch"),
    (["--ep", "2", "--experts", "3"], "--experts 3 is not divisible by --ep 2"),
    (["--experts", "4", "--topk", "5"], "1 <= topk <= 4"),
])
def test_bad_expert_options_exit_2(capsys, argv, message):
    assert verify_cli.main(argv) == 2
    assert message in capsys.readouterr().err
