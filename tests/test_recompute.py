"""Activation recomputation (minitron/model/recompute.py, ModelConfig.recompute) in ParallelGPT:
the same loss and gradients as without it (dropout masks redrawn equal), and the bytes a
layer saves for backward, counted with saved-tensor hooks, equal to the estimator's."""
import dataclasses

import pytest
import torch
import torch.distributed as dist

import minitron.model.recompute as recompute
from minitron.context_parallel.measure import saved_bytes
from minitron.grid import ParallelConfig, build_grid
from minitron.estimate.memory import Setup, activation_bytes_per_layer
from minitron.config import ModelConfig
from minitron.model.parallel import ParallelGPT

CFG = ModelConfig(vocab_size=64, seq_len=16, hidden=32, n_layers=2, n_heads=8, dropout=0.1)
B = 2
MODES = ("none", "selective", "full")


def _step(cfg, sp, plant_no_restore=False):
    """(loss, {name: grad}) of one training step on this rank."""
    if plant_no_restore:    # the planted bug: the recompute draws the NEXT masks, not the same
        recompute.restore_rng_site = lambda rng, site: None
    grid = build_grid(ParallelConfig(tp=dist.get_world_size(), sequence_parallel=sp))
    model = ParallelGPT(cfg, grid, seed=0).train()
    gen = torch.Generator().manual_seed(1)
    tokens, targets = torch.randint(0, cfg.vocab_size, (2, B, cfg.seq_len), generator=gen)
    model.rng.reset(7)
    _, loss = model(tokens, targets)
    loss.backward()
    model.finalize_grads()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _all_modes(sp, dropout_rng="exact", plant=False):
    return {m: _step(dataclasses.replace(CFG, recompute=m, dropout_rng=dropout_rng), sp,
                     plant and m != "none") for m in MODES}


def _worst(a: dict, b: dict) -> float:
    """Largest |difference| of any gradient, relative to that gradient's largest entry."""
    return max(float((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-30)) for n in b)


@pytest.mark.parametrize("tp, sp, dropout_rng", [(1, False, "exact"), (2, False, "exact"),
                                                 (2, True, "exact"), (2, True, "per_rank")])
def test_recompute_leaves_loss_and_gradients_unchanged(run_ranks, tp, sp, dropout_rng):
    for rank, out in enumerate(run_ranks(_all_modes, sp, dropout_rng, world_size=tp)):
        loss, grads = out["none"]
        for mode in ("selective", "full"):
            other_loss, other_grads = out[mode]
            assert torch.equal(other_loss, loss), (rank, mode)   # the forward is the same ops
            assert _worst(other_grads, grads) <= 1e-6, (rank, mode, _worst(other_grads, grads))


def test_planted_rng_not_restored_is_caught(run_ranks):
    # Without putting the RNG's site back, the recompute draws different dropout masks: the
    # gradients are those of a different network, far outside the 1e-6 the test allows.
    out = run_ranks(_all_modes, True, "exact", True, world_size=2)[0]
    for mode in ("selective", "full"):
        assert _worst(out[mode][1], out["none"][1]) > 1e-2, mode


def _saved_per_layer(sp):
    """Bytes of the distinct non-parameter storages block 0 saves for backward, per mode."""
    out = {}
    for mode in MODES:
        grid = build_grid(ParallelConfig(tp=dist.get_world_size(), sequence_parallel=sp))
        model = ParallelGPT(dataclasses.replace(CFG, recompute=mode), grid, seed=0).train()
        s_local = CFG.seq_len // grid.tp.size if sp else CFG.seq_len
        x = torch.randn(B, s_local, CFG.hidden, requires_grad=True)
        with saved_bytes(exclude=model.parameters()) as saved:
            y = model.layers[0](x, model.rng)
        y.sum().backward()          # the recompute runs; it must leave the forward's count alone
        out[mode] = saved.bytes
    return out


@pytest.mark.parametrize("tp, sp", [(1, False), (2, False), (2, True)])
def test_saved_bytes_per_layer_equal_the_estimator(run_ranks, tp, sp):
    per_rank = run_ranks(_saved_per_layer, sp, world_size=tp)
    assert all(r == per_rank[0] for r in per_rank), per_rank
    measured = per_rank[0]
    for mode in MODES:
        setup = Setup(tp=tp, sp=sp, recompute=mode, dtype="float32", micro_batch=B, seq=CFG.seq_len)
        assert measured[mode] == activation_bytes_per_layer(CFG, setup), (mode, measured)
    # the comparison can fail: the modes really differ, full keeps only the layer's input
    assert measured["full"] < measured["selective"] < measured["none"]
    assert measured["full"] == 4 * B * CFG.seq_len * CFG.hidden // (tp if sp else 1)


def _key(site: dict) -> tuple:
    return site["seed"], site["layer"], site["call"], site["first_row"]


def test_no_grad_runs_plainly_and_the_rng_is_left_as_found():
    from minitron.tensor_parallel.random import DropoutRNG
    rng = DropoutRNG(3)
    rng.at_layer(5)
    x = torch.randn(2, 4, requires_grad=True)
    f = lambda t, r: r.dropout(t * 2, 0.5, True)
    y = recompute.checkpoint(f, rng, x, others=(rng,))
    after = _key(recompute.rng_site(rng))
    rng.at_layer(9)                               # other work between forward and backward
    before_backward = _key(recompute.rng_site(rng))
    y.sum().backward()
    assert _key(recompute.rng_site(rng)) == before_backward   # the rerun left no trace
    rng2 = DropoutRNG(3)
    rng2.at_layer(5)
    x2 = x.detach().requires_grad_()
    f(x2, rng2).sum().backward()
    assert torch.equal(x.grad, x2.grad) and after == _key(recompute.rng_site(rng2))
    with torch.no_grad():
        assert recompute.checkpoint(f, rng, x, others=(rng,)).grad_fn is None


def test_bad_mode_is_refused():
    with pytest.raises(ValueError, match="recompute='some': choose one of"):
        ModelConfig(recompute="some")
