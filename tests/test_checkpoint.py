"""Distributed checkpoints: saved on one grid, loaded on another, the next step's loss is the
same; resumed on the same grid, the losses continue bit for bit; a save killed midway leaves
the previous checkpoint whole; a bad checkpoint fails naming the file and changes nothing."""
import contextlib
import json
import os

import pytest
import torch

from minitron.train import checkpoint
from minitron.grid import ParallelConfig
from minitron.runtime.launch import RankError
from minitron.config import ModelConfig
from minitron.train.engine import TrainingRun
from minitron.verify.faults import dies_mid_save

MCFG = ModelConfig(vocab_size=64, seq_len=8, hidden=32, n_layers=4, n_heads=4, dropout=0.1)
BATCH = 8
TOL = 1e-5          # fp32 next-step loss on another grid: only the sums' order differs (measured ~1e-7)


def batch(step):
    gen = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, MCFG.vocab_size, (BATCH, MCFG.seq_len + 1), generator=gen)
    return data[:, :-1], data[:, 1:]


def make_run(grid_kw, zero, seed=0):
    return TrainingRun(MCFG, ParallelConfig(**grid_kw), zero_stage=zero, microbatches=2,
                       lr=1e-2, seed=seed)


def train_and_save(grid_kw, zero, path, steps):
    """`steps` steps, save, then one more step: (losses, the loss of the step after the save)."""
    run = make_run(grid_kw, zero)
    losses = [run.step(*batch(s), s) for s in range(steps)]
    checkpoint.save(path, run.model, run.engine, run.optimizer, step=steps, extra={"data": steps})
    return losses, run.step(*batch(steps), steps)


def load_and_step(grid_kw, zero, path, seed=7):
    run = make_run(grid_kw, zero, seed=seed)     # another seed: loading must replace every weight
    before = run.evaluate(*batch(0))
    manifest = checkpoint.load(path, run.model, run.engine, run.optimizer)
    step = manifest["step"]
    return before, run.evaluate(*batch(0)), run.step(*batch(step), step), manifest["extra"]


# (saved at grid, ZeRO stage) -> loaded at [(grid, ZeRO stage), ...]
RESHARD = [((dict(tp=2, pp=2), 0), [(dict(pp=4), 0), (dict(tp=2, dp=2), 3)]),
           ((dict(dp=2, pp=2), 2), [(dict(tp=4), 1), (dict(dp=4), 1)])]


@pytest.mark.parametrize("saved, loads", RESHARD, ids=["tp2pp2", "dp2pp2-zero2"])
def test_load_on_another_grid_gives_the_same_next_loss(run_ranks, tmp_path, saved, loads):
    path = str(tmp_path / "ckpt")
    losses, next_loss = run_ranks(train_and_save, *saved, path, 2, world_size=4)[0]
    assert losses[1] < losses[0]
    for grid_kw, zero in loads:
        out = run_ranks(load_and_step, grid_kw, zero, path, world_size=4)
        before, after, loss, extra = out[0]
        assert all(o[2] == loss for o in out)                       # every rank agrees
        assert extra == {"data": 2}
        assert abs(before - after) > 1e-3, "the load changed nothing (test of the test)"
        assert abs(loss - next_loss) <= TOL * abs(next_loss), (grid_kw, zero, loss, next_loss)


def resume(path, steps, total):
    run = make_run(dict(dp=2), 1)
    manifest = checkpoint.load(path, run.model, run.engine, run.optimizer)
    return [run.step(*batch(s), s) for s in range(manifest["step"], total)]


def straight(total):
    run = make_run(dict(dp=2), 1)
    return [run.step(*batch(s), s) for s in range(total)]


def test_resume_is_bit_for_bit(run_ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    full = run_ranks(straight, 5, world_size=2)[0]
    first, third = run_ranks(train_and_save, dict(dp=2), 1, path, 2, world_size=2)[0]
    rest = run_ranks(resume, path, 2, 5, world_size=2)[0]
    assert first + rest == full                                      # exactly, on CPU
    assert rest[0] == third


def save_with_fault(path, fault):
    point, rank = fault
    run = make_run(dict(dp=2), 0, seed=3)
    run.step(*batch(0), 0)
    with dies_mid_save(point) if run.grid.rank == rank else contextlib.nullcontext():
        checkpoint.save(path, run.model, run.engine, run.optimizer, step=99)


def test_rank_killed_mid_save_leaves_the_previous_checkpoint(run_ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(train_and_save, dict(dp=2), 0, path, 1, world_size=2)
    files = sorted(os.listdir(path))
    for fault in [("written", 1), ("manifest", 0)]:
        with pytest.raises(RankError, match="died"):
            run_ranks(save_with_fault, path, fault, world_size=2)
        assert sorted(os.listdir(path)) == files
        assert json.load(open(os.path.join(path, checkpoint.MANIFEST)))["step"] == 1
        if fault[0] == "written":        # died before the manifest: the partial save is no checkpoint
            with pytest.raises(checkpoint.CheckpointError, match="manifest.json is missing"):
                checkpoint.read_manifest(path + ".partial")
    out = run_ranks(load_and_step, dict(dp=2), 0, path, world_size=2)
    assert out[0][3] == {"data": 1}


def load_expecting_error(path, mcfg):
    run = TrainingRun(mcfg, ParallelConfig(dp=2), seed=5)
    before = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    try:
        checkpoint.load(path, run.model, run.engine, run.optimizer)
    except checkpoint.CheckpointError as e:
        unchanged = all(torch.equal(p, before[n]) for n, p in run.model.named_parameters())
        return str(e), unchanged
    return None, True


def test_bad_checkpoints_fail_naming_the_file(run_ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(train_and_save, dict(dp=2), 0, path, 1, world_size=2)
    shard = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))[-1]
    other = ModelConfig(**{**MCFG.__dict__, "hidden": 64})
    msg, unchanged = run_ranks(load_expecting_error, path, other, world_size=2)[0]
    assert "incompatible model" in msg and "hidden=32" in msg and unchanged
    data = bytearray(open(os.path.join(path, shard), "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(os.path.join(path, shard), "wb").write(bytes(data))
    msg, unchanged = run_ranks(load_expecting_error, path, MCFG, world_size=2)[0]
    assert shard in msg and "corrupted" in msg and unchanged
    os.remove(os.path.join(path, shard))
    msg, unchanged = run_ranks(load_expecting_error, path, MCFG, world_size=2)[0]
    assert shard in msg and "missing" in msg and unchanged


def load_with_swapped_tp_pieces(path):
    """A planted placement bug: tp rank r reads rank (tp-1-r)'s piece of every split tensor."""
    right = checkpoint.placements

    def swapped(local, model, prefix):
        tp, out = model.grid.tp.size, {}
        for fqn, (t, shape, off) in right(local, model, prefix).items():
            off = [(tp - 1 - o // n) * n if n != full else o for o, n, full in zip(off, t.shape, shape)]
            out[fqn] = (t, shape, tuple(off))
        return out
    checkpoint.placements = swapped
    try:
        return load_and_step(dict(tp=2), 0, path)
    finally:
        checkpoint.placements = right


def test_a_wrong_placement_is_caught(run_ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    _, next_loss = run_ranks(train_and_save, dict(tp=2), 0, path, 2, world_size=2)[0]
    loss = run_ranks(load_with_swapped_tp_pieces, path, world_size=2)[0][2]
    assert abs(loss - next_loss) > 100 * TOL * abs(next_loss)


def save_with_a_nan_on_rank_1(path):
    run = make_run(dict(dp=2), 0, seed=3)
    run.step(*batch(0), 0)
    if run.grid.rank == 1:
        with torch.no_grad():
            next(run.model.parameters()).view(-1)[0] = float("nan")
    try:
        checkpoint.save(path, run.model, run.engine, run.optimizer, step=99)
    except checkpoint.CheckpointError as e:
        return str(e)


def test_non_finite_weights_are_never_saved(run_ranks, tmp_path):
    """A diverged run must not replace a good checkpoint: every rank refuses, even the one whose
    weights are finite, and the previous checkpoint stays."""
    path = str(tmp_path / "ckpt")
    run_ranks(train_and_save, dict(dp=2), 0, path, 1, world_size=2)
    errors = run_ranks(save_with_a_nan_on_rank_1, path, world_size=2)
    assert errors[0] == f"refusing to save {path}: non-finite values (NaN or inf) on another rank"
    assert errors[1].startswith(f"refusing to save {path}: non-finite values (NaN or inf) on this rank: model/")
    assert json.load(open(os.path.join(path, checkpoint.MANIFEST)))["step"] == 1
    assert not os.path.exists(path + ".partial")


@pytest.mark.parametrize("bad", [dict(lr=float("nan")), dict(lr=float("inf")), dict(lr=-1e-3),
                                 dict(weight_decay=float("nan")), dict(max_norm=float("nan"))])
def test_a_run_refuses_non_finite_hyperparameters(bad):
    with pytest.raises(ValueError, match="must be a finite number"):
        TrainingRun(MCFG, ParallelConfig(), **bad)       # before any process group is needed


def step_with_a_nan_weight():
    run = make_run(dict(dp=2), 0)
    with torch.no_grad():
        next(run.model.parameters()).view(-1)[0] = float("nan")
    weights = [p.detach().clone() for p in run.model.parameters()]
    try:
        run.step(*batch(0), 0)
    except FloatingPointError as e:
        return str(e), all(torch.allclose(p, w, rtol=0, atol=0, equal_nan=True)
                           for p, w in zip(run.model.parameters(), weights))
    return None, False


def test_a_non_finite_loss_stops_the_step_before_the_update(run_ranks):
    for message, untouched in run_ranks(step_with_a_nan_weight, world_size=2):
        assert message.startswith("step 1: the loss is nan: the run diverged") and untouched
