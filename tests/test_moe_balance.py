"""Aux-loss-free balancing (--balance aux-free, minitron/moe/balance.py): the experts' biases
after every optimizer step equal the one-device reference's bit for bit on ep2, ep2 x dp2 and
ep2 x pp2 (verify's `expert bias` row), and a bias moved by one rank's own counts fails it; the
loads' all-reduce costs exactly [layers, E] int64 per load group; the biases stay float32 in a
16-bit model, move only in training forwards, and a checkpoint carries them: a resumed run
continues with the biases (and the losses) of the uninterrupted one, at another grid too."""
import argparse
import dataclasses

import pytest
import torch

from minitron.config import ConfigError, ModelConfig
from minitron.grid import ParallelConfig
from minitron.model.reference import GPT
from minitron.moe.balance import update_biases
from minitron.runtime import comm
from minitron.train import checkpoint
from minitron.train.engine import TrainingRun, resolve_schedule
from minitron.train.flags import UsageError, balance_fields
from minitron.verify import Report, run_rank
from minitron.verify import cli as verify_cli

SMALL = dict(vocab_size=64, seq_len=8, hidden=32, n_layers=2, n_heads=4, dropout=0.1)
FREE = ModelConfig(**SMALL, n_experts=4, topk=2, expert_bias=True, aux_loss_coeff=0.0, z_loss_coeff=1e-3)
GRIDS = {"ep2": (ParallelConfig(ep=2), None, 2), "ep2-dp2": (ParallelConfig(ep=2, dp=2), None, 4),
         "ep2-pp2": (ParallelConfig(ep=2, pp=2), "1f1b", 8)}


def _verify(run_ranks, name, plant=None, steps=3):
    pcfg, schedule, batch = GRIDS[name]
    sched = resolve_schedule(pcfg, schedule, 4 if schedule else None)
    return Report(run_ranks(run_rank, pcfg, FREE, steps, batch=batch, plant=plant, schedule=sched,
                            world_size=pcfg.world_size)[0])


def _bias_rows(report):
    return [r for r in report.rows if r.quantity.startswith("expert bias")]


@pytest.mark.parametrize("name", list(GRIDS))
def test_split_biases_equal_one_devices_and_a_local_count_fails(run_ranks, name):
    report = _verify(run_ranks, name)
    assert report.passed, report.table()
    rows = _bias_rows(report)
    assert len(rows) == 3 and all(r.err == 0 for r in rows)
    assert "spread 0)" not in rows[-1].quantity, "the biases never moved (test of the test)"
    planted = _verify(run_ranks, name, plant="moe-local-load", steps=1)
    assert not planted.passed
    assert [r.quantity for r in planted.failures] == [rows[0].quantity], planted.table()
    assert planted.failures[0].err >= 1            # at least one update gone the wrong way


# ---- the loads' all-reduce: bytes ----
def _load_traffic(pcfg, cfg, batch):
    run = TrainingRun(cfg, pcfg, seed=0)
    gen = torch.Generator().manual_seed(3)
    data = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=gen)
    run.forward_backward(data[:, :-1], data[:, 1:], 0)
    layers = run.model.moe_layers()
    with comm.counting() as c:
        loads = update_biases(layers)
    grid = run.grid
    payload = len(layers) * cfg.n_experts * 8                 # [layers, E] int64
    want = {g.name: (payload, 2 * (g.size - 1) / g.size * payload)
            for g in layers[0].load_groups() if g.size > 1}
    got = {name: (c.bytes("all_reduce", name), c.wire_bytes("all_reduce", name)) for name in want}
    return got, want, c.calls(), int(loads.sum()), grid.ep_dp.size


@pytest.mark.parametrize("pcfg", [ParallelConfig(ep=2, dp=2), ParallelConfig(ep=2, tp=2, sequence_parallel=True),
                                  ParallelConfig(ep=2, pp=2)], ids=["ep2-dp2", "ep2-tp2-sp", "ep2-pp2"])
def test_load_reduction_bytes_equal_the_formula(run_ranks, pcfg):
    cfg = dataclasses.replace(FREE, n_layers=4, dropout=0.0)
    batch = 8
    for got, want, calls, total, _ in run_ranks(_load_traffic, pcfg, cfg, batch, world_size=pcfg.world_size):
        assert got == want and calls == len(want) >= 1
        layers = cfg.n_layers // pcfg.pp
        assert total == layers * batch * cfg.seq_len * cfg.topk   # every token of the batch, k times


# ---- one process ----
def test_bias_stays_float32_and_moves_only_in_training():
    model = GPT(FREE, seed=0).to(torch.bfloat16)
    layer = model.moe_layers()[0]
    assert layer.expert_bias.dtype == torch.float32
    tokens = torch.randint(0, FREE.vocab_size, (2, FREE.seq_len))
    with torch.no_grad():
        model(tokens)
    assert layer.step_load is None                 # no_grad: an evaluation or a sample
    model(tokens, tokens)[1].backward()
    assert int(layer.step_load.sum()) == 2 * FREE.seq_len * FREE.topk
    update_biases(model.moe_layers())
    assert layer.step_load is None and layer.expert_bias.abs().max() == pytest.approx(1e-3)
    assert "expert_bias" not in model.state_dict()


def _args(**kw):
    base = dict(balance="aux-loss", bias_update_rate=None)
    return argparse.Namespace(**{**base, **kw})


def test_balance_flags():
    assert balance_fields(_args()) == {"expert_bias": False}
    assert balance_fields(_args(balance="aux-free")) == {"expert_bias": True, "aux_loss_coeff": 0.0}
    assert balance_fields(_args(balance="aux-free", aux_loss=0.01, bias_update_rate=0.01)) == \
        {"expert_bias": True, "aux_loss_coeff": 0.01, "bias_update_rate": 0.01}
    with pytest.raises(UsageError, match="add --balance aux-free or drop --bias-update-rate"):
        balance_fields(_args(bias_update_rate=0.01))
    with pytest.raises(ConfigError, match="has none"):
        ModelConfig(expert_bias=True)
    with pytest.raises(ConfigError, match="bias_update_rate=0.001"):
        ModelConfig(n_experts=4, expert_bias=True, bias_update_rate=float("nan"))


@pytest.mark.parametrize("argv,message", [
    (["--balance", "aux-free"], "--balance aux-free steers the routers of MoE layers, and --experts 0"),
    (["--experts", "4", "--ep", "2", "--tp", "1", "--bias-update-rate", "0.01"], "add --balance aux-free"),
    (["--experts", "4", "--ep", "2", "--tp", "1", "--balance", "aux-free", "--bias-update-rate", "0"],
     "use --bias-update-rate 0.001"),
    (["--experts", "4", "--ep", "2", "--tp", "1", "--plant", "moe-local-load"], "add --balance aux-free"),
])
def test_bad_balance_options_exit_2(capsys, argv, message):
    assert verify_cli.main(argv) == 2
    assert message in capsys.readouterr().err


# ---- checkpoints ----
CKPT = dataclasses.replace(FREE, n_layers=4, bias_update_rate=0.01)


def _batch(step):
    gen = torch.Generator().manual_seed(500 + step)
    data = torch.randint(0, CKPT.vocab_size, (8, CKPT.seq_len + 1), generator=gen)
    return data[:, :-1], data[:, 1:]


def _biases(run):
    return checkpoint.biases_of_every_stage(run.model)


def _train_save_continue(grid_kw, path, steps, total):
    run = TrainingRun(CKPT, ParallelConfig(**grid_kw), microbatches=2, lr=1e-2)
    for s in range(steps):
        run.step(*_batch(s), s)
    checkpoint.save(path, run.model, run.engine, run.optimizer, step=steps)
    saved = _biases(run)
    losses = [run.step(*_batch(s), s) for s in range(steps, total)]
    return saved, losses, _biases(run)


def _resume(grid_kw, path, total, load=True):
    run = TrainingRun(CKPT, ParallelConfig(**grid_kw), microbatches=2, lr=1e-2, seed=5)
    start = 3
    if load:
        start = checkpoint.load(path, run.model, run.engine, run.optimizer)["step"]
    loaded = _biases(run)
    losses = [run.step(*_batch(s), s) for s in range(start, total)]
    return loaded, losses, _biases(run)


def test_a_resumed_run_continues_with_the_same_biases(run_ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    saved, losses, final = run_ranks(_train_save_continue, dict(ep=2, pp=2), path, 3, 5, world_size=4)[0]
    assert any(b != 0 for layer in saved for b in layer)
    loaded, again, final_again = run_ranks(_resume, dict(ep=2, pp=2), path, 5, world_size=4)[0]
    assert loaded == saved and again == losses and final_again == final       # bit for bit
    other = run_ranks(_resume, dict(ep=4), path, 5, world_size=4)[0]          # another grid
    assert other[0] == saved and other[2] == final
    fresh = run_ranks(_resume, dict(ep=2, pp=2), path, 5, False, world_size=4)[0]
    assert fresh[0] != saved, "a run without the checkpoint starts from zero biases (test of the test)"
