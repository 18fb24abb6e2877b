"""The AdamW step on CPU (kernels/ops.fused_adamw_step): torch's fused kernel, every element
rounded alike wherever a shard boundary falls, so ZeRO's replicas stay bitwise equal."""
import pytest
import torch

from minitron.kernels import ops

HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
N = 16 * 61 + 13          # a tail of 13 elements, and shard boundaries off the 16-element grid


def _state(n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    p, grad, m, v = (torch.randn(n, generator=g) * s for s in (0.02, 1e-3, 1e-4, 1e-3))
    return [p, grad, m, v * v]


def _steps(state, cuts, steps=3):
    """`steps` AdamW steps, each as one call per piece [cuts[i], cuts[i+1])."""
    p, grad, m, v = state
    for step in range(1, steps + 1):
        for lo, hi in zip(cuts, cuts[1:]):
            ops.fused_adamw_step(p[lo:hi], grad[lo:hi], m[lo:hi], v[lo:hi], step=step, **HP)
    return p, m, v


@pytest.mark.parametrize("cuts", [(0, 7, 500, 501, N), (0, 333, N), (0, 16, 32, N - 1, N)],
                         ids=["odd-shards", "two-shards", "aligned-then-one"])
def test_the_update_does_not_depend_on_where_the_shards_are_cut(cuts):
    whole = _steps(_state(), (0, N))
    sharded = _steps(_state(), cuts)
    for a, b in zip(whole, sharded):
        assert torch.equal(a, b)


def test_cpu_fp32_takes_torchs_fused_kernel_on_whole_units(monkeypatch):
    # without the interpreter: under TRITON_INTERPRET=1 (read on every call) CPU tensors take
    # the Triton kernel instead, which tests/test_kernels.py holds against torch's AdamW
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    calls = []
    real = torch._fused_adamw_

    def spy(params, *rest, **kwargs):
        calls.append([t.numel() for t in params])
        return real(params, *rest, **kwargs)
    monkeypatch.setattr(torch, "_fused_adamw_", spy)
    _steps(_state(), (0, 5, N), steps=1)
    # every tensor the kernel sees is whole 16-element units: no element takes its scalar loop
    assert calls and all(n % 16 == 0 for sizes in calls for n in sizes)
    assert sum(sum(sizes) for sizes in calls) == 16 + (N - 5) // 16 * 16 + 16   # tails padded


def test_agrees_with_torchs_adamw():
    p, grad, _, _ = _state()
    m, v = torch.zeros_like(p), torch.zeros_like(p)     # torch's optimizer starts at zero moments
    ref = torch.nn.Parameter(p.clone())
    opt = torch.optim.AdamW([ref], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                            weight_decay=HP["weight_decay"], foreach=False)
    for step in range(1, 4):
        ref.grad = grad.clone()
        opt.step()
        ops.fused_adamw_step(p, grad, m, v, step=step, **HP)
    assert torch.allclose(p, ref.detach(), rtol=0, atol=4 * torch.finfo(torch.float32).eps * 0.1)
    assert torch.allclose(m, opt.state[ref]["exp_avg"], rtol=1e-6, atol=0)
