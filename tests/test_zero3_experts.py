"""ZeRO-3 with experts (data_parallel/zero3.py split_expert_units): each MoE layer's experts are a
unit of their own, sharded over dp_cp (the ranks holding the same experts) inside the layer's
unit, sharded over dense_dp. Checked against one device (verify), traffic counted per group
against 3m (N-1)/N of each unit's bytes, a planted wrong group caught, and the trainer's curve
equal to ZeRO-1's."""
import json

import pytest
import torch

from minitron import verify
from minitron.data_parallel import DataParallel, ZeroStage3, gathered_grads
from minitron.data_parallel import zero3
from minitron.grid import ParallelConfig, build_grid
from minitron.model import ModelConfig, ParallelGPT
from minitron.runtime import comm
from minitron.train import cli as train_cli
from minitron.train.step import forward_backward
from minitron.verify import make_batch

MOE = ModelConfig(vocab_size=64, seq_len=8, hidden=32, n_layers=2, n_heads=4, n_experts=4, topk=2,
                  dropout=0.0)
PCFG = ParallelConfig(ep=2, dp=2)        # dense_dp = 4 ranks, dp_cp = 2


@pytest.mark.parametrize("pcfg", [PCFG, ParallelConfig(cp=2, ep=2)], ids=["ep2-dp2", "cp2-ep2"])
def test_zero3_with_experts_matches_one_device(pcfg):
    report = verify.verify(pcfg, MOE, steps=2, zero=3, microbatches=None)
    assert report.passed, report.verdict()
    assert any("experts.fc1.weight" in r.quantity for r in report.rows)


def _grads(model, engine, grid, micro):
    tokens, targets = make_batch(0, 0, 8, MOE.seq_len, MOE.vocab_size)
    engine.zero_grad()
    with comm.counting() as c:
        forward_backward(model, None, tokens, targets, 0, engine=engine, microbatches=micro)
    return gathered_grads(engine), c


def traffic_rank(micro, plant):
    grid = build_grid(PCFG)
    if plant:        # the experts' unit sharded over dense_dp, like the layer's
        real = zero3.reduction_group
        zero3.reduction_group = lambda p, g: g.dense_dp_shard
    try:
        engine = ZeroStage3(ParallelGPT(MOE, grid, seed=0), grid)
    finally:
        if plant:
            zero3.reduction_group = real
    grads, c = _grads(engine.model, engine, grid, micro)
    ddp_model = ParallelGPT(MOE, grid, seed=0)
    ref, _ = _grads(ddp_model, DataParallel(ddp_model, grid, zero_stage=1), grid, micro)
    worst = max(float((grads[n] - ref[n]).abs().max() / ref[n].abs().max().clamp_min(1e-30))
                for n in ref)
    expected = {}
    for u in engine.units:
        expected[u.group.name] = expected.get(u.group.name, 0) + \
            3 * micro * (u.group.size - 1) / u.group.size * u.layout.numel * 4
    wire = {name: sum(c.wire_bytes(op, name) for op in ("all_gather", "reduce_scatter"))
            for name in expected}            # not the routers' counts, all-reduced over dense_dp
    return worst, expected, wire, sorted({(u.group.name, u.group.size) for u in engine.units})


@pytest.mark.parametrize("micro", [1, 2])
def test_each_unit_travels_over_its_own_group_counted_exactly(run_ranks, micro):
    worst, expected, wire, groups = run_ranks(traffic_rank, micro, False, world_size=4)[0]
    assert groups == [("dense_dp", 4), ("dp_cp", 2)]
    assert wire == expected and expected["dp_cp"] > 0
    assert worst < 1e-5                   # the same gradients as ZeRO-1's buckets


def test_a_unit_of_experts_sharded_over_the_wrong_group_is_caught(run_ranks):
    worst, *_ = run_ranks(traffic_rank, 1, True, world_size=4)[0]
    assert worst > 1e-2


def test_the_trainer_runs_it_on_zero1s_curve(tmp_path, capfd):
    losses = {}
    for zero in (1, 3):
        out = tmp_path / f"zero{zero}"
        assert train_cli.main(["--ep", "2", "--experts", "4", "--dp", "2", "--zero", str(zero),
                               "--steps", "2", "--batch", "4", "--seq", "16", "--hidden", "32",
                               "--eval-every", "2", "--sample", "0", "--save-every", "0",
                               "--out", str(out)]) == 0
        losses[zero] = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").open()]
    capfd.readouterr()
    assert torch.allclose(torch.tensor(losses[3]), torch.tensor(losses[1]), rtol=1e-5), losses
