"""Vocab-parallel cross entropy against F.cross_entropy: per-token loss, gradient, bytes;
the plain and the fused (kernels) public losses alike on ignored and out-of-range targets
and at large logits."""
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from minitron.runtime import comm
from minitron.runtime.comm import single_group
from minitron.grid import ParallelConfig, build_grid
from minitron.tensor_parallel import cross_entropy as ce
from minitron.tensor_parallel.cross_entropy import (fused_vocab_parallel_cross_entropy,
                                                     vocab_parallel_cross_entropy)
from minitron.verify.compare import rel_err

B, S, V = 2, 8, 64
TOL_LOSS, TOL_GRAD = 1e-5, 1e-4


def _problem(dtype=torch.float32):
    """Logits far from 0 (exp would overflow without the max shift); every shard owns targets."""
    gen = torch.Generator().manual_seed(0)
    logits = (10 * torch.randn(B, S, V, generator=gen) + 100).to(dtype)
    targets = (torch.arange(B * S) * 9 + 2) % V  # 2, 11, 20, ...: every quarter of the vocab
    weights = torch.rand(B, S, generator=gen)     # a non-uniform upstream gradient
    return logits, targets.view(B, S), weights


def _reference(logits, targets, weights):
    x = logits.detach().float().requires_grad_()
    loss = F.cross_entropy(x.view(-1, V), targets.view(-1), reduction="none").view(B, S)
    (loss * weights).sum().backward()
    return loss.detach(), x.grad


def _run(dtype=torch.float32, drop_call=None):
    """This rank's loss and gathered logits gradient; drop_call=k plants a bug: the k-th
    all-reduce of the forward is skipped (0: max, 1: target logit, 2: sum of exp)."""
    group = build_grid(ParallelConfig(tp=dist.get_world_size())).tp
    logits, targets, weights = _problem(dtype)
    loss_ref, grad_ref = _reference(logits, targets, weights)

    shard = logits.chunk(group.size, -1)[group.rank].clone().requires_grad_()
    calls = []

    def all_reduce(t, g, op="sum"):
        calls.append(op)
        return t if len(calls) - 1 == drop_call else comm.all_reduce(t, g, op)

    if drop_call is not None:
        ce.comm = types.SimpleNamespace(all_reduce=all_reduce)
    try:
        with comm.counting() as fwd:
            loss = vocab_parallel_cross_entropy(shard, targets, group)
        with comm.counting() as bwd:
            (loss * weights).sum().backward()
    finally:
        ce.comm = comm
    grad = comm.all_gather(shard.grad, group, dim=-1)
    owns = ((targets // (V // group.size)) == group.rank).any().item()
    return {"loss": rel_err(loss, loss_ref), "grad": rel_err(grad.float(), grad_ref),
            "loss_dtype": loss.dtype, "grad_dtype": shard.grad.dtype, "owns_targets": owns,
            "fwd": fwd.as_dict(), "bwd": bwd.as_dict()}


@pytest.mark.parametrize("n", [2, 4])
def test_matches_cross_entropy_with_three_small_all_reduces(run_ranks, n):
    N = B * S
    for res in run_ranks(_run, world_size=n):
        assert res["owns_targets"]  # every shard holds some target
        assert res["loss"] <= TOL_LOSS and res["grad"] <= TOL_GRAD, res
        # max, target logit, sum of exp: 3 all-reduces of N floats, never the [N, V] logits
        assert res["fwd"] == {"tp/all_reduce": {"calls": 3, "bytes": 3 * N * 4,
                                                "wire_bytes": 3 * 2 * (n - 1) / n * N * 4}}
        assert res["bwd"] == {}     # the gradient is local
        assert res["loss_dtype"] == torch.float32 and res["grad_dtype"] == torch.float32


def test_half_precision_logits_are_computed_in_float32(run_ranks):
    for res in run_ranks(_run, torch.bfloat16, world_size=2):
        # the reference upcasts the same bf16 values, so only the gradient's rounding differs
        assert res["loss"] <= TOL_LOSS and res["grad"] <= 1e-2, res
        assert res["loss_dtype"] == torch.float32 and res["grad_dtype"] == torch.bfloat16


@pytest.mark.parametrize("drop", [0, 1, 2], ids=["no_global_max", "no_target_sum", "no_expsum_sum"])
def test_each_all_reduce_is_needed(run_ranks, drop):
    """A test of the test: skip any one of the three all-reduces and the comparison fails."""
    results = run_ranks(_run, None, drop, world_size=2)
    assert max(res["loss"] for res in results) > 1e-2
    assert all(res["fwd"]["tp/all_reduce"]["calls"] == 2 for res in results)


def test_one_rank_is_plain_cross_entropy():
    logits, targets, weights = _problem()
    loss_ref, grad_ref = _reference(logits, targets, weights)
    x = logits.clone().requires_grad_()
    with comm.counting() as c:
        loss = vocab_parallel_cross_entropy(x, targets, single_group())
        (loss * weights).sum().backward()
    assert rel_err(loss, loss_ref) <= TOL_LOSS and rel_err(x.grad, grad_ref) <= TOL_GRAD
    assert c.as_dict() == {}


def test_shape_mismatch_is_rejected():
    with pytest.raises(ValueError, match="targets' shape"):
        vocab_parallel_cross_entropy(torch.zeros(2, 3, 8), torch.zeros(2, 4, dtype=torch.long),
                                     single_group())


LOSSES = {"plain": vocab_parallel_cross_entropy, "fused": fused_vocab_parallel_cross_entropy}


def _run_against_torch(name, offset=0.0, ignore_every=0):
    """Both public losses on this rank's shard against F.cross_entropy in float64, with every
    ignore_every-th target -100 (0: none): the mean over the kept tokens, the per-token losses,
    the gathered gradient of that mean."""
    group = build_grid(ParallelConfig(tp=dist.get_world_size())).tp
    logits, targets, _ = _problem()
    logits = logits - 100 + offset  # _problem's logits sit near 100
    if ignore_every:
        targets.view(-1)[::ignore_every] = -100
    kept = targets != -100
    x = logits.double().requires_grad_()
    ref_losses = F.cross_entropy(x.view(-1, V), targets.view(-1), reduction="none").view(B, S)
    ref = F.cross_entropy(x.view(-1, V), targets.view(-1))   # ignore_index=-100, mean over the rest
    ref.backward()
    shard = logits.chunk(group.size, -1)[group.rank].clone().requires_grad_()
    losses = LOSSES[name](shard, targets, group)
    loss = losses.sum() / kept.sum()
    loss.backward()
    grad = comm.all_gather(shard.grad, group, dim=-1)
    return {"mean": rel_err(loss, ref), "losses": rel_err(losses, ref_losses),
            "grad": rel_err(grad, x.grad), "ignored_losses": losses[~kept].abs().sum().item(),
            "ignored_grad": grad[~kept].abs().sum().item(), "n_ignored": int((~kept).sum())}


@pytest.mark.parametrize("name", list(LOSSES))
def test_ignored_targets_as_torch_does(run_ranks, name):
    """-100 (torch's ignore_index): loss 0 and no gradient for that token, in both losses;
    the mean over the other tokens is F.cross_entropy's."""
    for res in run_ranks(_run_against_torch, name, 0.0, 3, world_size=2):
        assert res["n_ignored"] == 6 and res["ignored_losses"] == 0 and res["ignored_grad"] == 0, res
        assert res["mean"] <= TOL_LOSS and res["losses"] <= TOL_LOSS and res["grad"] <= TOL_GRAD, res


@pytest.mark.parametrize("offset", [0.0, 1e2, 1e4])
@pytest.mark.parametrize("name", list(LOSSES))
def test_large_logits_keep_float32_accuracy(run_ranks, name, offset):
    """The same softmax shifted by 1e4: both losses work relative to the max, so their
    errors stay those of float32 at the size of the losses and probabilities themselves."""
    for res in run_ranks(_run_against_torch, name, offset, 0, world_size=2):
        assert res["losses"] <= 2e-7 and res["grad"] <= 6e-7, res


@pytest.mark.parametrize("target", [-1, -101, V, V + 5])
def test_targets_outside_the_vocabulary_are_rejected_alike(target):
    logits, targets, _ = _problem()
    targets[1, 3] = target
    messages = []
    for fn in LOSSES.values():
        with pytest.raises(ValueError, match=rf"targets must be in \[0, {V}\) or ignore_index \(-100\); "
                                             rf"got {target}") as err:
            fn(logits.clone().requires_grad_(), targets, single_group())
        messages.append(str(err.value))
    assert messages[0] == messages[1]
