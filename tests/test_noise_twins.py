"""verify/noise.py's twins cut every reduction they list: each op of CUTS, run inside
SplitReductions in bfloat16, gives the sum of its two parts, each rounded to bfloat16, computed
here by hand, and not the op's own result. So a cut that stops firing (an op renamed, a
shape guard wrong) fails here rather than shrinking the noise floor of every 16-bit verdict
unseen."""
import pytest
import torch
import torch.nn.functional as F

from minitron.verify import noise

FRAC = 0.3
BF16 = torch.bfloat16


def _k(n):                      # where SplitReductions(FRAC) cuts n terms
    return noise._parts(n, FRAC)[0].stop


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(BF16)


def _mm():
    a, b = _rand(8, 64, seed=1), _rand(64, 8, seed=2)
    k = _k(64)
    return (lambda: a @ b), a[:, :k] @ b[:k] + a[:, k:] @ b[k:]


def _addmm():
    c, a, b = _rand(8, 8, seed=3), _rand(8, 64, seed=1), _rand(64, 8, seed=2)
    k = _k(64)
    return (lambda: torch.addmm(c, a, b)), c + (a[:, :k] @ b[:k] + a[:, k:] @ b[k:])


def _bmm():
    a, b = _rand(2, 8, 64, seed=1), _rand(2, 64, 8, seed=2)
    k = _k(64)
    by_hand = torch.bmm(a[:, :, :k], b[:, :k]) + torch.bmm(a[:, :, k:], b[:, k:])
    return (lambda: torch.bmm(a, b)), by_hand


def _sum():
    x = _rand(64, 8, seed=4)
    k = _k(64)
    return (lambda: x.sum(0)), x[:k].sum(0) + x[k:].sum(0)


def _layer_norm_dw():
    x, w, b, dy = _rand(64, 16, seed=5), _rand(16, seed=6), _rand(16, seed=7), _rand(64, 16, seed=8)

    def dw(rows):
        w_ = w.clone().requires_grad_()
        F.layer_norm(x[rows], (16,), w_, b).backward(dy[rows])
        return w_.grad
    k = _k(64)
    return (lambda: dw(slice(None))), dw(slice(0, k)) + dw(slice(k, None))


def _embedding_dw():
    table, ids, dy = _rand(10, 16, seed=9), torch.arange(64) % 10, _rand(64, 16, seed=10)

    def dw(rows):
        t = table.clone().requires_grad_()
        F.embedding(ids[rows], t).backward(dy[rows])
        return t.grad
    k = _k(64)
    return (lambda: dw(slice(None))), dw(slice(0, k)) + dw(slice(k, None))


CASES = {"mm": _mm, "addmm": _addmm, "bmm": _bmm, "sum": _sum,
         "layer norm dW": _layer_norm_dw, "embedding dW": _embedding_dw}


def test_every_cut_has_a_case():
    assert len(CASES) == len(noise.CUTS)


@pytest.mark.parametrize("name", CASES)
def test_each_reduction_runs_as_two_rounded_parts(name):
    run, by_hand = CASES[name]()
    whole = run()
    with noise.SplitReductions(FRAC):
        cut = run()
    assert torch.equal(cut, by_hand), f"{name}: the twin's result is not its two parts' sum"
    assert not torch.equal(cut, whole), f"{name}: the twin ran the op whole"
