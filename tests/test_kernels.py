"""Every fused kernel against a float64 torch reference, forward and gradients.

Without a GPU the kernels run in Triton's interpreter on CPU tensors, which is
slow, so shapes are tiny but deliberately awkward: 37 rows, hidden 97, seq 33,
vocab 1013, so that every kernel has a tail to mask. With a GPU (and
TRITON_INTERPRET unset) the same checks run compiled on CUDA, in 16-bit too.

Every output buffer a kernel writes starts as NaN (ops.POISON), so an element
no program instance wrote fails the comparison.
"""
import os

import torch

# Before anything imports triton: with no GPU, interpret the kernels on the CPU.
_SET_HERE = "TRITON_INTERPRET" not in os.environ
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.device_count() > 0 else "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from minitron.kernels import bench, ops  # noqa: E402

INTERPRET = ops.interpreting()
_VALUE = os.environ["TRITON_INTERPRET"]
if _SET_HERE:  # only while this file's tests run (fixture below): the rest of the suite,
    del os.environ["TRITON_INTERPRET"]  # and the workers it starts, keep torch on CPU


@pytest.fixture(autouse=True, scope="module")
def _interpreter_while_here():
    # The kernel modules are imported lazily, by the first op that runs here, so
    # they see the variable (triton.jit picks interpreter or compiler right then).
    if _SET_HERE:
        os.environ["TRITON_INTERPRET"] = _VALUE
    yield
    if _SET_HERE:
        os.environ.pop("TRITON_INTERPRET", None)

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.skipif(
        INTERPRET or not torch.cuda.is_available(), reason="needs a GPU, interpreter off")),
]

# |actual - expected| <= atol * max(1, max|expected|) + rtol * |expected|, per dtype.
# fp32 kernels differ from float64 by summation order only; 16-bit ones also
# round their inputs' products' results to 8 (bf16) or 11 (fp16) mantissa bits.
TOL = {
    torch.float32: (1e-5, 1e-4),
    torch.float16: (2e-3, 5e-3),
    torch.bfloat16: (1.6e-2, 2e-2),
}


def assert_close(actual, expected, dtype, what, factor=1.0):
    """The comparison every test (and the test of the tests) goes through."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    actual = actual.detach().double().cpu()
    expected = expected.detach().double().cpu()
    assert torch.isfinite(actual).all(), f"{what}: non-finite values (an unwritten output?)"
    atol, rtol = (factor * t for t in TOL[dtype])
    scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
    err = (actual - expected).abs()
    bad = err > atol * scale + rtol * expected.abs()
    assert not bad.any(), (f"{what} ({dtype}): {int(bad.sum())}/{bad.numel()} elements off, "
                           f"max error {err.max().item():.3g} at scale {scale:.3g}")


@pytest.fixture(autouse=True)
def poison():
    ops.POISON = True
    yield
    ops.POISON = False


def check_op(op, reference, inputs, dtype, what, factor=1.0, grad_factor=None):
    """Forward and input gradients of op vs the float64 reference."""
    inputs = [t.requires_grad_() if t.is_floating_point() else t for t in inputs]
    # ops silently takes its torch twin when a kernel cannot run: make sure this one can.
    assert ops._triton_path(inputs[0]), f"{what}: the kernel would not run here (torch fallback)"
    out = op(*inputs)
    diff = [t for t in inputs if t.requires_grad]
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, diff, dout)

    ref_in = [t.detach().double().requires_grad_() if t.is_floating_point() else t for t in inputs]
    with ops.use_triton(False):
        ref = reference(*ref_in)
    ref_grads = torch.autograd.grad(ref, [t for t in ref_in if t.requires_grad], dout.double())

    assert_close(out, ref, dtype, f"{what} forward", factor)
    for i, (g, rg) in enumerate(zip(grads, ref_grads)):
        assert_close(g, rg, dtype, f"{what} grad {i}", grad_factor or factor)


def rand(*shape, dtype, device, scale=1.0):
    return (torch.randn(*shape, dtype=torch.float32) * scale).to(device=device, dtype=dtype)


# --------------------------------------------------------------------------- norms
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37, 97), (2, 3, 64)])
def test_rms_norm(device, dtype, shape):
    torch.manual_seed(0)
    x = rand(*shape, dtype=dtype, device=device)
    w = rand(shape[-1], dtype=dtype, device=device) + 1
    check_op(lambda x, w: ops.rms_norm(x, w, 1e-5), lambda x, w: ops.rms_norm(x, w, 1e-5),
             [x, w], dtype, "rms_norm", grad_factor=2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37, 97), (2, 3, 64)])
def test_layer_norm(device, dtype, shape):
    torch.manual_seed(0)
    x = rand(*shape, dtype=dtype, device=device, scale=3) + 2  # an offset the mean must remove
    w = rand(shape[-1], dtype=dtype, device=device) + 1
    b = rand(shape[-1], dtype=dtype, device=device)
    check_op(ops.layer_norm, ops.layer_norm, [x, w, b], dtype, "layer_norm", grad_factor=2)


# --------------------------------------------------------------------------- softmax
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,shape,causal", [
    (torch.float32, (1, 2, 33, 33), True),
    (torch.float16, (2, 1, 17, 17), True),
    (torch.float32, (1, 2, 7, 45), False),
])
def test_scaled_masked_softmax(device, dtype, shape, causal):
    torch.manual_seed(0)
    x = rand(*shape, dtype=dtype, device=device, scale=2)
    op = lambda s: ops.scaled_masked_softmax(s, 0.37, causal)  # noqa: E731
    check_op(op, op, [x], dtype, "softmax")


# --------------------------------------------------------------------------- attention
ATTN_CASES = [  # b, hq, hkv, sq, sk, d, causal, dtype
    (1, 2, 1, 33, 33, 16, True, torch.float32),
    (2, 4, 2, 20, 37, 32, False, torch.float32),
    (1, 2, 2, 40, 24, 16, True, torch.float32),
    (1, 2, 1, 24, 40, 16, True, torch.float32),
    (1, 2, 1, 33, 33, 16, True, torch.bfloat16),
    (1, 2, 2, 24, 24, 64, True, torch.float16),
    (1, 1, 1, 17, 17, 128, False, torch.bfloat16),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ATTN_CASES, ids=lambda c: "-".join(map(str, c[:7])) + f"-{c[7]}"[6:])
def test_flash_attention(device, case):
    b, hq, hkv, sq, sk, d, causal, dtype = case
    torch.manual_seed(0)
    q = rand(b, hq, sq, d, dtype=dtype, device=device)
    k = rand(b, hkv, sk, d, dtype=dtype, device=device)
    v = rand(b, hkv, sk, d, dtype=dtype, device=device)
    op = lambda q, k, v: ops.flash_attention(q, k, v, causal=causal)  # noqa: E731
    check_op(op, op, [q, k, v], dtype, "flash_attention", grad_factor=2)


@pytest.mark.parametrize("device", DEVICES)
def test_flash_attention_strided_layout(device):
    """q, k, v as [b, s, h, d] projections viewed as [b, h, s, d]: read in place, no copy."""
    torch.manual_seed(0)
    q, k, v = (rand(2, 19, h, 16, dtype=torch.float32, device=device) for h in (4, 2, 2))
    op = lambda q, k, v: ops.flash_attention(  # noqa: E731
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, scale=0.3)
    check_op(op, op, [q, k, v], torch.float32, "flash_attention strided")


@pytest.mark.parametrize("device", DEVICES)
def test_flash_attention_lse_and_its_gradient(device):
    """lse is natural-log logsumexp, and gradients flow through it too (ring attention)."""
    torch.manual_seed(0)
    q, k, v = (rand(1, 2, 21, 16, dtype=torch.float32, device=device) for _ in range(3))

    def op(q, k, v):
        out, lse = ops.flash_attention(q, k, v, causal=False, scale=0.3, return_lse=True)
        return torch.cat([out.flatten(), lse.flatten()])

    check_op(op, op, [q, k, v], torch.float32, "flash_attention+lse")


# --------------------------------------------------------------------------- cross entropy
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy(device, dtype):
    torch.manual_seed(0)
    N, V = 37, 1013
    logits = rand(N, V, dtype=dtype, device=device, scale=3)
    targets = torch.randint(0, V, (N,), device=device)
    targets[::5] = -100
    op = lambda x: ops.cross_entropy(x, targets)  # noqa: E731
    check_op(op, op, [logits], dtype, "cross_entropy")
    with ops.use_triton(False):  # the fallback is F.cross_entropy itself
        ref = torch.nn.functional.cross_entropy(logits.double(), targets)
    assert_close(ops.cross_entropy(logits, targets), ref, dtype, "cross_entropy vs F")


@pytest.mark.parametrize("device", DEVICES)
def test_vocab_parallel_cross_entropy_one_shard(device):
    torch.manual_seed(0)
    N, V = 37, 1013
    logits = rand(N, V, dtype=torch.float32, device=device, scale=3)
    targets = torch.randint(0, V, (N,), device=device)
    targets[3] = -100
    ident = lambda t: t  # noqa: E731
    op = lambda x: ops.vocab_parallel_cross_entropy(x, targets, 0, ident, ident)  # noqa: E731
    check_op(op, op, [logits], torch.float32, "vocab_parallel_ce")
    assert op(logits)[3].item() == 0.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("use_kernel", [True, False])
def test_vocab_parallel_cross_entropy_two_shards(device, use_kernel):
    """Two tensor-parallel ranks simulated in one process: each rank's fake
    all-reduce combines its tensor with the other shard's partial statistics."""
    torch.manual_seed(0)
    N, V, half = 37, 1013, 500  # uneven shards on purpose
    logits = rand(N, V, dtype=torch.float32, device=device, scale=3)
    targets = torch.randint(0, V, (N,), device=device)
    targets[::7] = -100
    shards = [logits[:, :half].contiguous(), logits[:, half:].contiguous()]
    starts = [0, half]
    with ops.use_triton(use_kernel):
        partials = [ops.vocab_parallel_ce_partials(s, targets, st) for s, st in zip(shards, starts)]
        merged = ops.merge_vocab_parallel_partials(partials, targets)
    ref = torch.nn.functional.cross_entropy(logits.double(), targets, reduction="none")
    assert_close(merged, ref, torch.float32, "merged partials")

    grads = []
    for rank in (0, 1):
        other_max, other_sumexp, other_tgt = partials[1 - rank]
        global_max = torch.maximum(partials[0][0], partials[1][0])

        def fake_max(t):
            t.copy_(torch.maximum(t, other_max))

        def fake_sum(t):  # t = [sum-exp at the global max, target logit]
            t[0] += other_sumexp * torch.exp(other_max - global_max)
            t[1] += other_tgt

        shard = shards[rank].clone().requires_grad_()
        with ops.use_triton(use_kernel):
            loss = ops.vocab_parallel_cross_entropy(shard, targets, starts[rank], fake_max, fake_sum)
        assert_close(loss, ref, torch.float32, f"rank {rank} losses")
        (grad,) = torch.autograd.grad(loss.sum(), shard)
        grads.append(grad)
    x = logits.double().requires_grad_()
    ref_loss = torch.nn.functional.cross_entropy(x, targets, reduction="sum")
    (ref_grad,) = torch.autograd.grad(ref_loss, x)
    assert_close(torch.cat(grads, 1), ref_grad, torch.float32, "sharded gradient")


# --------------------------------------------------------------------------- MLP activations
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu(device, dtype):
    torch.manual_seed(0)
    g, u = rand(37, 97, dtype=dtype, device=device, scale=2), rand(37, 97, dtype=dtype, device=device)
    check_op(ops.swiglu, ops.swiglu, [g, u], dtype, "swiglu")


@pytest.mark.parametrize("device", DEVICES)
def test_swiglu_on_halves_of_one_projection(device):
    """gate and up as the two (strided) halves of one [.., 2F] tensor."""
    torch.manual_seed(0)
    x = rand(3, 5, 2 * 97, dtype=torch.float32, device=device, scale=2)
    op = lambda x: ops.swiglu(*x.chunk(2, dim=-1))  # noqa: E731
    check_op(op, op, [x], torch.float32, "swiglu halves")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu(device, dtype, approximate):
    torch.manual_seed(0)
    x, b = rand(37, 97, dtype=dtype, device=device, scale=2), rand(97, dtype=dtype, device=device)
    op = lambda x, b: ops.bias_gelu(x, b, approximate)  # noqa: E731
    check_op(op, op, [x, b], dtype, f"bias_gelu[{approximate}]", grad_factor=2)


def test_bias_gelu_exact_is_torch_default():
    x = torch.linspace(-4, 4, 101, dtype=torch.float64)
    with ops.use_triton(False):
        y = ops.bias_gelu(x, torch.zeros(1, dtype=torch.float64))
    torch.testing.assert_close(y, torch.nn.functional.gelu(x))


# --------------------------------------------------------------------------- AdamW
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_fused_adamw_matches_torch(device, grad_dtype):
    torch.manual_seed(0)
    n = 1013
    hp = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ref = torch.nn.Parameter(torch.randn(n, device=device))
    opt = torch.optim.AdamW([ref], fused=False, foreach=False, **hp)
    p = ref.detach().clone()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    model = torch.empty(n, dtype=torch.bfloat16, device=device)
    for step in range(1, 4):
        grad = torch.randn(n, device=device).to(grad_dtype)
        ref.grad = grad.float()
        opt.step()
        ops.fused_adamw_step(p, grad, m, v, lr=hp["lr"], beta1=0.9, beta2=0.95, eps=hp["eps"],
                             weight_decay=hp["weight_decay"], step=step, model_param=model)
    state = opt.state[ref]
    # "to float32 rounding": a few units in the last place, of each element or, where
    # the lerp cancels, of the largest (older interpreters' fma rounds twice)
    for name, got, want in (("param", p, ref.detach()), ("exp_avg", m, state["exp_avg"]),
                            ("exp_avg_sq", v, state["exp_avg_sq"])):
        atol = 2 ** -22 * want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=4e-7, atol=atol, msg=name)
    torch.testing.assert_close(model, p.to(torch.bfloat16), rtol=0, atol=0)


# --------------------------------------------------------------------------- the switches
def test_available_and_use_triton_switch(monkeypatch):
    assert ops.available() == (ops._triton_importable() and (torch.cuda.is_available() or INTERPRET))
    x = torch.randn(4, 8)
    with ops.use_triton(False):
        assert not ops._triton_path(x)
        with ops.use_triton(True):
            assert ops._triton_path(x) == (ops.available() and INTERPRET)
        assert not ops._triton_path(x)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not ops._triton_path(x)  # a CPU tensor, no interpreter: torch


def test_bench_smoke(tmp_path, capsys):
    """The benchmark script end to end at tiny sizes (numbers meaningless here)."""
    if not INTERPRET:
        pytest.skip("the GPU run is the real benchmark")
    path = tmp_path / "k.csv"
    assert bench.run(["--smoke", "--no-compile", "--quick", "--csv", str(path)]) == 0
    rows = path.read_text().splitlines()
    assert rows[0].split(",") == bench.FIELDS and len(rows) > 10
    os.environ.pop("TRITON_INTERPRET")
    try:
        if not torch.cuda.is_available():
            assert bench.run([]) == 0 and "Nothing was run" in capsys.readouterr().out
    finally:
        os.environ["TRITON_INTERPRET"] = _VALUE


def test_poison_is_real():
    ops.POISON = True
    assert torch.isnan(ops.alloc((3,), torch.float32, "cpu")).all()
    ops.POISON = False
    with pytest.raises(AssertionError, match="non-finite"):
        assert_close(torch.full((3,), float("nan")), torch.zeros(3), torch.float32, "poisoned")


# --------------------------------------------------------------------------- the test of the tests
# Each case copies a kernel file, plants one bug by a textual edit and checks
# that the comparison above catches it, while the unedited copy, loaded the
# same way, passes. The edits are the bugs such kernels really get.
MUTANTS = {
    "tail of a row not masked (padding counted in the mean square)": (
        "rmsnorm", "x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)\n    rstd",
        "x = tl.load(X + row * stride_x + cols, mask=mask, other=1.0).to(tl.float32)\n    rstd"),
    "last row never written (caught by the NaN poison)": (
        "rmsnorm", "_rmsnorm_fwd[(M,)]", "_rmsnorm_fwd[(M - 1,)]"),
    "causal softmax sees one key too many": (
        "softmax", "(cols <= row % sq)", "(cols <= row % sq + 1)"),
    "flash attention causal mask off by one": (
        "flash_attention", "s = tl.where(offs_m[:, None] >= offs_n[None, :]",
        "s = tl.where(offs_m[:, None] + 1 >= offs_n[None, :]"),
    "dK/dV summed over one query head of the group only": (
        "flash_attention", "for g in range(0, GROUP):", "for g in range(0, 1):"),
    "vocab tail padded with 0 instead of -inf": (
        "cross_entropy", 'mask=cols < V, other=float("-inf"))', "mask=cols < V, other=0.0)"),
}


def _load_kernel_copy(tmp_path, name, old, new):
    import importlib.util

    import minitron.kernels as pkg
    src = open(os.path.join(os.path.dirname(pkg.__file__), f"{name}.py")).read()
    assert src.count(old) == 1, f"the edit must hit {name}.py exactly once"
    src = src.replace(old, new).replace("from .", "from minitron.kernels.")
    path = tmp_path / f"copy_of_{name}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"copy_of_{name}_{abs(hash(new))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_through(module, name, device):
    torch.manual_seed(0)
    f32 = torch.float32
    if name == "rmsnorm":
        x, w = rand(37, 97, dtype=f32, device=device), rand(97, dtype=f32, device=device)
        check_op(lambda x, w: module.RMSNormFn.apply(x, w, 1e-5),
                 lambda x, w: ops.rms_norm(x, w, 1e-5), [x, w], f32, "rms_norm")
    elif name == "softmax":
        x = rand(1, 2, 33, 33, dtype=f32, device=device)
        check_op(lambda s: module.ScaledMaskedSoftmaxFn.apply(s, 0.5, True),
                 lambda s: ops.scaled_masked_softmax(s, 0.5, True), [x], f32, "softmax")
    elif name == "flash_attention":
        q = rand(1, 4, 33, 16, dtype=f32, device=device)
        k, v = (rand(1, 2, 33, 16, dtype=f32, device=device) for _ in range(2))
        check_op(lambda q, k, v: module.FlashAttentionFn.apply(q, k, v, True, 0.25)[0],
                 lambda q, k, v: ops.flash_attention(q, k, v, True, 0.25), [q, k, v], f32, "attention")
    elif name == "cross_entropy":
        x = rand(37, 1013, dtype=f32, device=device)
        t = torch.randint(0, 1013, (37,), device=device)
        check_op(lambda x: module.CrossEntropyFn.apply(x, t, 0, None, None, -100),
                 lambda x: torch.nn.functional.cross_entropy(x, t, reduction="none"), [x], f32, "ce")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bug", list(MUTANTS))
def test_the_comparison_catches_planted_bugs(tmp_path, device, bug):
    name, old, new = MUTANTS[bug]
    _run_through(_load_kernel_copy(tmp_path, name, old, old), name, device)  # control: passes
    with pytest.raises(AssertionError):
        _run_through(_load_kernel_copy(tmp_path, name, old, new), name, device)
