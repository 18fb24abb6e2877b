"""FP8 GEMMs under zero-bubble schedules: an FP8 layer's dL/dW is deferred like any other
(weight_grad.defer), the same FP8 GEMM run later, so W gives bitwise the full backward's gradient;
and zb-h1 / zb-v verify against one device in FP8 (the fp8-deferred-dw refusal is gone)."""
import pytest
import torch

from minitron import verify
from minitron.grid import ParallelConfig
from minitron.model import ModelConfig
from minitron.tensor_parallel import weight_grad
from minitron.tensor_parallel.fp8 import FP8Recipe
from minitron.tensor_parallel.fp8_linear import FP8State, fp8_linear


def _grads(defer: bool):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 8, generator=gen).bfloat16().requires_grad_()
    w = torch.nn.Parameter(torch.randn(4, 8, generator=gen).bfloat16())
    b = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    state = FP8State(FP8Recipe("current"))
    with weight_grad.capture():
        y = fp8_linear(x, w, b, state)
    with weight_grad.deferring("mb0") if defer else weight_grad.deferring(None):
        y.float().pow(2).sum().backward()
    deferred = w.grad is None and b.grad is None
    ran = weight_grad.STORE.pop("mb0")
    return x.grad, w.grad, b.grad, deferred, ran


def test_an_fp8_layers_weight_gradient_is_deferred_and_equal():
    dx, dw, db, deferred, ran = _grads(defer=True)
    dx0, dw0, db0, deferred0, ran0 = _grads(defer=False)
    assert deferred and ran == 1 and not deferred0 and ran0 == 0
    assert torch.equal(dx, dx0) and torch.equal(dw, dw0) and torch.equal(db, db0)


@pytest.mark.parametrize("schedule, recipe, layers", [("zb-h1", "delayed", 2), ("zb-v", "current", 4)])
def test_fp8_under_deferring_schedules_matches_one_device(schedule, recipe, layers):
    mcfg = ModelConfig(vocab_size=128, seq_len=16, hidden=64, n_layers=layers, n_heads=4, dropout=0.1)
    dtype, fp8 = torch.bfloat16, FP8Recipe(recipe)
    report = verify.verify(ParallelConfig(pp=2), mcfg, steps=2, dtype=dtype, fp8=fp8,
                           schedule=schedule, microbatches=4)
    assert report.passed, report.verdict()
