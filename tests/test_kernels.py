"""Every fused kernel against an independent float64 oracle, forward and gradients:
torch's own op (F.rms_norm, F.layer_norm, F.scaled_dot_product_attention,
F.cross_entropy, torch.optim.AdamW) or the definition written here, never ops'
torch fallbacks (they are code under test too).

Without a GPU the kernels run in Triton's interpreter on CPU tensors, which is
slow, so shapes are tiny but deliberately awkward: 37 rows, hidden 97, seq 33,
vocab 1013, so that every kernel has a tail to mask; and, for flash attention,
key lengths with no tail (the unmasked path a GPU mostly takes) and forced
rectangular tiles. With a GPU (and TRITON_INTERPRET unset) the same checks run
compiled on CUDA, in 16-bit too.

Every output buffer a kernel writes starts as NaN (common.POISON), so an element
no program instance wrote fails the comparison.
"""
import inspect
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

# Before anything imports triton: with no GPU, interpret the kernels on the CPU.
_SET_HERE = "TRITON_INTERPRET" not in os.environ
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.device_count() > 0 else "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from minitron.kernels import common, ops  # noqa: E402
from minitron.verify.compare import rel_err  # noqa: E402

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
    common.POISON = True
    yield
    common.POISON = False


def check_op(op, reference, inputs, dtype, what, factor=1.0, grad_factor=None):
    """Forward and input gradients of op vs reference, an independent float64 oracle (torch's
    own op or the definition written here: never ops' fallbacks, which are code under test)."""
    inputs = [t.requires_grad_() if t.is_floating_point() else t for t in inputs]
    # ops silently takes its torch twin when a kernel cannot run: make sure this one can.
    assert ops._triton_path(inputs[0]), f"{what}: the kernel would not run here (torch fallback)"
    out = op(*inputs)
    diff = [t for t in inputs if t.requires_grad]
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, diff, dout)

    ref_in = [t.detach().double().requires_grad_() if t.is_floating_point() else t for t in inputs]
    ref = reference(*ref_in)
    ref_grads = torch.autograd.grad(ref, [t for t in ref_in if t.requires_grad], dout.double())

    assert_close(out, ref, dtype, f"{what} forward", factor)
    for i, (g, rg) in enumerate(zip(grads, ref_grads)):
        assert_close(g, rg, dtype, f"{what} grad {i}", grad_factor or factor)


def rand(*shape, dtype, device, scale=1.0):
    return (torch.randn(*shape, dtype=torch.float32) * scale).to(device=device, dtype=dtype)


def causal_keep(sq, sk, device):
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril()  # query i sees keys j <= i


def ref_attention(q, k, v, causal, scale=None):
    """torch's scaled_dot_product_attention (top-left causal mask, as the kernel's)."""
    try:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
    except TypeError:  # torch < 2.5 has no enable_gqa
        group = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                              is_causal=causal, scale=scale)


def ref_attention_lse(q, k, causal, scale):
    s = q @ k.repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(~causal_keep(*s.shape[-2:], s.device), float("-inf"))
    return torch.logsumexp(s, -1)


# --------------------------------------------------------------------------- norms
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37, 97), (2, 3, 64)])
def test_rms_norm(device, dtype, shape):
    torch.manual_seed(0)
    x = rand(*shape, dtype=dtype, device=device)
    w = rand(shape[-1], dtype=dtype, device=device) + 1
    check_op(lambda x, w: ops.rms_norm(x, w, 1e-5), lambda x, w: F.rms_norm(x, x.shape[-1:], w, 1e-5),
             [x, w], dtype, "rms_norm", grad_factor=2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37, 97), (2, 3, 64)])
def test_layer_norm(device, dtype, shape):
    torch.manual_seed(0)
    x = rand(*shape, dtype=dtype, device=device, scale=3) + 2  # an offset the mean must remove
    w = rand(shape[-1], dtype=dtype, device=device) + 1
    b = rand(shape[-1], dtype=dtype, device=device)
    check_op(ops.layer_norm, lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, 1e-5),
             [x, w, b], dtype, "layer_norm", grad_factor=2)


# --------------------------------------------------------------------------- softmax
def ref_softmax(scores, scale, causal):
    s = scores * scale
    if causal:
        s = s.masked_fill(~causal_keep(*s.shape[-2:], s.device), float("-inf"))
    return torch.softmax(s, -1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,shape,causal", [
    (torch.float32, (1, 2, 33, 33), True),
    (torch.float16, (2, 1, 17, 17), True),
    (torch.float32, (1, 2, 7, 45), False),
])
def test_scaled_masked_softmax(device, dtype, shape, causal):
    torch.manual_seed(0)
    x = rand(*shape, dtype=dtype, device=device, scale=2)
    check_op(lambda s: ops.scaled_masked_softmax(s, 0.37, causal), lambda s: ref_softmax(s, 0.37, causal),
             [x], dtype, "softmax")


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's cost: needs TRITON_INTERPRET=1")
def test_the_interpreter_patches_the_language_once_per_module_and_launch(monkeypatch):
    """common.patch_language_once_per_launch: a softmax launch of 66 rows calls tl.max and tl.sum
    (jit functions of triton.language.standard) in each, 132 device calls. The language is patched
    for the launch and once for standard's module, not 133 times. (That the output stays torch's
    is test_scaled_masked_softmax's.)"""
    from triton.runtime import interpreter
    scores = torch.randn(1, 2, 33, 33)
    ops.scaled_masked_softmax(scores, 0.5, True)                  # installs the mends
    patches = []

    class Counted(interpreter._LangPatchScope):                   # one per patch of the language
        def __init__(self):
            super().__init__()
            patches.append(1)
    monkeypatch.setattr(interpreter, "_LangPatchScope", Counted)
    mended = ops.scaled_masked_softmax(scores, 0.5, True)
    assert len(patches) == 2, f"triton.language patched {len(patches)} times in one launch"
    patches.clear()                                               # the test of the test
    unmended = inspect.getclosurevars(interpreter._patch_lang).nonlocals["real"]
    monkeypatch.setattr(interpreter, "_patch_lang", unmended)
    assert torch.equal(ops.scaled_masked_softmax(scores, 0.5, True), mended)
    assert len(patches) == 1 + 2 * 66, len(patches)


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


def _attention(device, case, tiles=None):
    b, hq, hkv, sq, sk, d, causal, dtype = case
    torch.manual_seed(0)
    q = rand(b, hq, sq, d, dtype=dtype, device=device)
    k = rand(b, hkv, sk, d, dtype=dtype, device=device)
    v = rand(b, hkv, sk, d, dtype=dtype, device=device)
    from minitron.kernels import flash_attention as flash
    flash.last_launch.clear()
    with flash.tiles(**(tiles or {})):
        check_op(lambda q, k, v: ops.flash_attention(q, k, v, causal=causal),
                 lambda q, k, v: ref_attention(q, k, v, causal), [q, k, v], dtype, "flash_attention",
                 grad_factor=2)
    return flash.last_launch


def _case_id(c):
    return "-".join(map(str, c[:7])) + f"-{c[7]}"[6:]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ATTN_CASES, ids=_case_id)
def test_flash_attention(device, case):
    _attention(device, case)


# Key lengths that are a multiple of BLOCK_N take the unmasked EVEN_N path, the common one on
# a GPU (s = 4096 and the like); rectangular tiles put several key blocks on the causal
# diagonal (forward, dQ) or several query blocks (dK/dV), which square tiles never do.
RECT = dict(fwd=(32, 16), dkdv=(16, 32), dq=(32, 16))
WIDE = dict(fwd=(64, 32), dkdv=(32, 64), dq=(64, 32))
TILE_CASES = [  # attention case, tiles (None: the interpreter's 16 x 16), EVEN_N expected
    ((1, 2, 1, 32, 32, 16, True, torch.float32), None, True),
    ((1, 2, 1, 48, 48, 16, True, torch.float32), RECT, True),
    ((2, 4, 2, 48, 32, 16, True, torch.float32), RECT, True),
    ((1, 2, 2, 32, 48, 32, False, torch.float32), RECT, True),
    ((1, 2, 1, 48, 48, 16, True, torch.bfloat16), RECT, True),
    ((1, 2, 1, 48, 48, 16, True, torch.float32), WIDE, False),  # BLOCK_N 32 on 48 keys: a tail
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case,tiles,even", TILE_CASES,
                         ids=[f"{_case_id(c)}-{t and t['fwd']}" for c, t, _ in TILE_CASES])
def test_flash_attention_tiles_and_even_keys(device, case, tiles, even):
    ran = _attention(device, case, tiles)
    want = {k: {"BLOCK_M": m, "BLOCK_N": n, "EVEN_N": case[4] % n == 0}
            for k, (m, n) in (tiles or dict(fwd=(16, 16), dkdv=(16, 16), dq=(16, 16))).items()}
    assert ran == want and ran["fwd"]["EVEN_N"] == ran["dq"]["EVEN_N"] == even, ran


@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("s", [128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_flash_attention_gpu_lengths_take_the_unmasked_path(s, dtype):
    """The key lengths of real runs, tiles picked by autotune (fp32 from its own lists)."""
    ran = _attention("cuda", (2, 4, 2, s, s, 64, True, dtype))
    assert ran["fwd"]["EVEN_N"] and ran["dq"]["EVEN_N"], ran


def test_tiles_are_checked():
    from minitron.kernels import flash_attention as flash
    with pytest.raises(ValueError, match="BLOCK_M a multiple of BLOCK_N"):
        flash.tiles(fwd=(16, 32))
    with pytest.raises(ValueError, match="powers of two >= 16"):
        flash.tiles(dq=(24, 8))


@pytest.mark.parametrize("device", DEVICES)
def test_flash_attention_strided_layout(device):
    """q, k, v as [b, s, h, d] projections viewed as [b, h, s, d]: read in place, no copy."""
    torch.manual_seed(0)
    q, k, v = (rand(2, 19, h, 16, dtype=torch.float32, device=device) for h in (4, 2, 2))
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    check_op(lambda q, k, v: ops.flash_attention(t(q), t(k), t(v), causal=True, scale=0.3),
             lambda q, k, v: ref_attention(t(q), t(k), t(v), True, 0.3), [q, k, v], torch.float32,
             "flash_attention strided")


@pytest.mark.parametrize("device", DEVICES)
def test_flash_attention_lse_and_its_gradient(device):
    """lse is natural-log logsumexp, and gradients flow through it too (ring attention)."""
    torch.manual_seed(0)
    q, k, v = (rand(1, 2, 21, 16, dtype=torch.float32, device=device) for _ in range(3))

    def op(q, k, v):
        out, lse = ops.flash_attention(q, k, v, causal=False, scale=0.3, return_lse=True)
        return torch.cat([out.flatten(), lse.flatten()])

    def ref(q, k, v):
        return torch.cat([ref_attention(q, k, v, False, 0.3).flatten(),
                          ref_attention_lse(q, k, False, 0.3).flatten()])

    check_op(op, ref, [q, k, v], torch.float32, "flash_attention+lse")


# The forward kernel once multiplied int32 indices by int32 strides: with a head stride of
# 2**30 elements, head 2 sat at offset -2**31. Views of one 4 GiB buffer (address space only:
# its untouched pages cost no memory) reach such offsets at a tiny size. In a subprocess, since
# a wrong address crashes it; the kernel must give bitwise what it gives on a dense copy.
LARGE_OFFSETS = r"""
import os
os.environ["TRITON_INTERPRET"] = "1"
import torch
from minitron.kernels import ops
torch.manual_seed(0)
big = torch.empty(2 ** 31 + 4096, dtype=torch.bfloat16)
k, v = (torch.randn(1, 1, 16, 16).to(torch.bfloat16) for _ in range(2))
H, R = 2 ** 30, 2 ** 27
for name, shape, stride in (("head", (1, 3, 16, 16), (3 * H, H, 16, 1)),    # h * stride_h = 2**31
                            ("row", (1, 1, 17, 16), (17 * R, 17 * R, R, 1))):  # row 16 * stride = 2**31
    q = big.as_strided(shape, stride)
    q.copy_(torch.randn(shape))
    same = torch.equal(ops.flash_attention(q, k, v, causal=True), ops.flash_attention(q.contiguous(), k, v))
    print(f"{name} stride: same as dense: {same}")
"""


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's view of a 4 GiB CPU buffer")
def test_flash_attention_offsets_past_2_31():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", LARGE_OFFSETS], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, f"the kernel crashed (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    assert proc.stdout.split("\n")[:2] == ["head stride: same as dense: True",
                                          "row stride: same as dense: True"], proc.stdout


# --------------------------------------------------------------------------- cross entropy
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy(device, dtype):
    torch.manual_seed(0)
    N, V = 37, 1013
    logits = rand(N, V, dtype=dtype, device=device, scale=3)
    targets = torch.randint(0, V, (N,), device=device)
    targets[::5] = -100
    check_op(lambda x: ops.cross_entropy(x, targets), lambda x: F.cross_entropy(x, targets),
             [logits], dtype, "cross_entropy")


@pytest.mark.parametrize("device", DEVICES)
def test_vocab_parallel_cross_entropy_one_shard(device):
    torch.manual_seed(0)
    N, V = 37, 1013
    logits = rand(N, V, dtype=torch.float32, device=device, scale=3)
    targets = torch.randint(0, V, (N,), device=device)
    targets[3] = -100
    ident = lambda t: t  # noqa: E731
    op = lambda x: ops.vocab_parallel_cross_entropy(x, targets, 0, ident, ident)  # noqa: E731
    check_op(op, lambda x: F.cross_entropy(x, targets, reduction="none"), [logits], torch.float32,
             "vocab_parallel_ce")
    assert op(logits)[3].item() == 0.0


def two_rank_losses(logits, targets, half, use_kernel):
    """Two tensor-parallel ranks simulated in one process: each rank's fake all-reduce adds
    the other shard's partial statistics. (per-token losses of rank 0, of rank 1, gradient)."""
    shards = [logits[:, :half].contiguous(), logits[:, half:].contiguous()]
    starts = [0, half]
    with ops.use_triton(use_kernel):
        partials = [ops.vocab_parallel_ce_partials(s, targets, st) for s, st in zip(shards, starts)]
    out, grads = [], []
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
        out.append(loss)
        grads.append(torch.autograd.grad(loss.sum(), shard)[0])
    return out, torch.cat(grads, 1), ops.merge_vocab_parallel_partials(partials, targets)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("use_kernel", [True, False])
def test_vocab_parallel_cross_entropy_two_shards(device, use_kernel):
    torch.manual_seed(0)
    N, V, half = 37, 1013, 500  # uneven shards on purpose
    logits = rand(N, V, dtype=torch.float32, device=device, scale=3)
    targets = torch.randint(0, V, (N,), device=device)
    targets[::7] = -100
    losses, grad, merged = two_rank_losses(logits, targets, half, use_kernel)
    x = logits.double().requires_grad_()
    ref = F.cross_entropy(x, targets, reduction="none")
    (ref_grad,) = torch.autograd.grad(ref.sum(), x)
    for what, got in (("merged partials", merged), ("rank 0 losses", losses[0]), ("rank 1 losses", losses[1])):
        assert_close(got, ref, torch.float32, what)
    assert_close(grad, ref_grad, torch.float32, "sharded gradient")


def ce_errors(logits, targets, use_kernel):
    """Worst relative error (see minitron.verify.compare.rel_err) of the losses and of the gradient,
    through one shard and through two, against float64."""
    x = logits.double().requires_grad_()
    ref = F.cross_entropy(x, targets, reduction="none")
    (ref_grad,) = torch.autograd.grad(ref.sum(), x)
    one = logits.clone().requires_grad_()
    ident = lambda t: t  # noqa: E731
    with ops.use_triton(use_kernel):
        loss = ops.vocab_parallel_cross_entropy(one, targets, 0, ident, ident)
    (grad,) = torch.autograd.grad(loss.sum(), one)
    losses, grad2, merged = two_rank_losses(logits, targets, logits.shape[1] // 3, use_kernel)
    return (max(rel_err(t, ref) for t in (loss, *losses, merged)),
            max(rel_err(g, ref_grad) for g in (grad, grad2)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "torch_twin"])
@pytest.mark.parametrize("offset", [0.0, 1e2, 1e4])
def test_cross_entropy_keeps_float32_accuracy_at_large_logits(device, use_kernel, offset):
    """x + 1e4 has the same softmax; a float32 lse = 1e4 + log(S) is off by up to 5e-4 and so
    would be every loss and probability made from it. Kept relative to the max, errors stay
    at float32's 6e-8 of the quantities themselves (the bounds leave a few ulps of room)."""
    torch.manual_seed(0)
    logits = rand(37, 1013, dtype=torch.float32, device=device, scale=3) + offset
    targets = torch.randint(0, 1013, (37,), device=device)
    targets[::7] = -100
    loss_err, grad_err = ce_errors(logits, targets, use_kernel)
    assert loss_err < 2e-7 and grad_err < 6e-7, f"relative error: loss {loss_err:.2e} grad {grad_err:.2e}"


@pytest.mark.parametrize("target", [-1, -101, 1013, 1013 + 5])
def test_cross_entropy_rejects_targets_outside_the_vocabulary(target):
    targets = torch.zeros(4, dtype=torch.long)
    targets[2] = target
    with pytest.raises(ValueError, match=rf"targets must be in \[0, 1013\) or ignore_index \(-100\); got {target}"):
        ops.cross_entropy(torch.zeros(4, 1013), targets)


# --------------------------------------------------------------------------- MLP activations
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu(device, dtype):
    torch.manual_seed(0)
    g, u = rand(37, 97, dtype=dtype, device=device, scale=2), rand(37, 97, dtype=dtype, device=device)
    check_op(ops.swiglu, lambda g, u: F.silu(g) * u, [g, u], dtype, "swiglu")


@pytest.mark.parametrize("device", DEVICES)
def test_swiglu_on_halves_of_one_projection(device):
    """gate and up as the two (strided) halves of one [.., 2F] tensor."""
    torch.manual_seed(0)
    x = rand(3, 5, 2 * 97, dtype=torch.float32, device=device, scale=2)
    check_op(lambda x: ops.swiglu(*x.chunk(2, dim=-1)), lambda x: F.silu(x[..., :97]) * x[..., 97:],
             [x], torch.float32, "swiglu halves")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu(device, dtype, approximate):
    """'none' against the erf definition x * Phi(x) (torch's default GeLU), 'tanh' against
    torch's tanh approximation."""
    torch.manual_seed(0)
    x, b = rand(37, 97, dtype=dtype, device=device, scale=2), rand(97, dtype=dtype, device=device)
    if approximate == "none":
        ref = lambda x, b: (x + b) * 0.5 * (1 + torch.erf((x + b) / 2 ** 0.5))  # noqa: E731
    else:
        ref = lambda x, b: F.gelu(x + b, approximate="tanh")  # noqa: E731
    check_op(lambda x, b: ops.bias_gelu(x, b, approximate), ref, [x, b], dtype, f"bias_gelu[{approximate}]",
             grad_factor=2)


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
    assert ops._triton_path(p), "the kernel would not run here (torch fallback)"
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
    x = torch.randn(4, 8)
    assert ops.available() and ops._triton_path(x) == INTERPRET  # triton is here (importorskip)
    with ops.use_triton(False):
        assert not ops._triton_path(x)
        with ops.use_triton(True):
            assert ops._triton_path(x) == INTERPRET
        assert not ops._triton_path(x)
    monkeypatch.setattr(ops, "_triton_importable", lambda: False)
    assert not ops.available() and not ops._triton_path(x)  # no triton: never the kernels
    monkeypatch.undo()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not ops._triton_path(x)  # a CPU tensor, no interpreter: torch
    assert ops.available() == (torch.cuda.device_count() > 0)


def test_poison_is_real():
    common.POISON = True
    assert torch.isnan(common.alloc((3,), torch.float32, "cpu")).all()
    common.POISON = False
    with pytest.raises(AssertionError, match="non-finite"):
        assert_close(torch.full((3,), float("nan")), torch.zeros(3), torch.float32, "poisoned")


# --------------------------------------------------------------------------- the test of the tests
# Each case copies a kernel file, plants one bug by a textual edit and checks that the
# comparison above catches it, with the message expected, while the unedited copy, loaded
# the same way, passes. The edits are the bugs such kernels really get.
MUTANTS = {  # name: (kernel file, text, replacement, message expected)
    "tail of a row not masked (padding counted in the mean square)": (
        "rmsnorm", "x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)\n    rstd",
        "x = tl.load(X + row * stride_x + cols, mask=mask, other=1.0).to(tl.float32)\n    rstd",
        "rms_norm forward .* elements off"),
    "last row never written (caught by the NaN poison)": (
        "rmsnorm", "_rmsnorm_fwd[(M,)]", "_rmsnorm_fwd[(M - 1,)]", "rms_norm forward: non-finite"),
    "causal softmax sees one key too many": (
        "softmax", "(cols <= row % sq)", "(cols <= row % sq + 1)", "softmax forward .* elements off"),
    "flash attention causal mask off by one": (
        "flash_attention", "s = tl.where(offs_m[:, None] >= offs_n[None, :]",
        "s = tl.where(offs_m[:, None] + 1 >= offs_n[None, :]", "attention forward .* elements off"),
    "dK/dV summed over one query head of the group only": (
        "flash_attention_bwd", "for g in range(0, GROUP):", "for g in range(0, 1):", "attention grad 1 .* elements off"),
    "causal diagonal one key block long (right for square tiles only)": (
        "flash_attention", "end = tl.minimum(pid_m * BLOCK_M + BLOCK_M, sk)\n    else:\n        diag = sk\n        end = sk\n"
        "    acc", "end = tl.minimum(pid_m * BLOCK_M + BLOCK_N, sk)\n    else:\n        diag = sk\n        end = sk\n"
        "    acc", "attention forward .* elements off"),
    "vocab tail padded with 0 instead of -inf": (
        "cross_entropy", 'mask=cols < V, other=float("-inf"))', "mask=cols < V, other=0.0)", "ce forward .* elements off"),
    "softmax rebuilt from lse = max + log(sum) (float32 at the logits' scale)": (
        "cross_entropy", "tl.exp((x - m) - log_sum)", "tl.exp(x - (m + log_sum))", "ce relative error: .* grad"),
}


def _load_kernel_copy(tmp_path, name, old, new):
    import importlib.util

    import minitron.kernels as pkg
    src = open(os.path.join(os.path.dirname(pkg.__file__), f"{name}.py")).read()
    assert src.count(old) == 1, f"the edit must hit {name}.py exactly once"
    src = src.replace(old, new).replace("from .", "from minitron.kernels.")
    unique = f"copy_of_{name}_{abs(hash(new))}"
    path = tmp_path / f"{unique}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(unique, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[unique] = module
    spec.loader.exec_module(module)
    if name == "flash_attention_bwd":   # the backward kernels run through a copy of their launcher
        launcher = open(os.path.join(os.path.dirname(pkg.__file__), "flash_attention.py")).read()
        launcher = launcher.replace("from .flash_attention_bwd import", f"from {unique} import")
        return _load_source_copy(tmp_path, "flash_attention", launcher, unique + "_launcher")
    return module


def _load_source_copy(tmp_path, name, src, unique):
    import importlib.util
    path = tmp_path / f"{unique}.py"
    path.write_text(src.replace("from .", "from minitron.kernels."))
    spec = importlib.util.spec_from_file_location(unique, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_through(module, name, device, tiles=RECT):
    torch.manual_seed(0)
    f32 = torch.float32
    if name == "rmsnorm":
        x, w = rand(37, 97, dtype=f32, device=device), rand(97, dtype=f32, device=device)
        check_op(lambda x, w: module.RMSNormFn.apply(x, w, 1e-5),
                 lambda x, w: F.rms_norm(x, (97,), w, 1e-5), [x, w], f32, "rms_norm")
    elif name == "softmax":
        x = rand(1, 2, 33, 33, dtype=f32, device=device)
        check_op(lambda s: module.ScaledMaskedSoftmaxFn.apply(s, 0.5, True),
                 lambda s: ref_softmax(s, 0.5, True), [x], f32, "softmax")
    elif name in ("flash_attention", "flash_attention_bwd"):
        q = rand(1, 4, 48, 16, dtype=f32, device=device)
        k, v = (rand(1, 2, 48, 16, dtype=f32, device=device) for _ in range(2))
        with module.tiles(**tiles):
            check_op(lambda q, k, v: module.FlashAttentionFn.apply(q, k, v, True, 0.25)[0],
                     lambda q, k, v: ref_attention(q, k, v, True, 0.25), [q, k, v], f32, "attention")
    elif name == "cross_entropy":
        x = rand(37, 1013, dtype=f32, device=device)
        t = torch.randint(0, 1013, (37,), device=device)
        check_op(lambda x: module.CrossEntropyFn.apply(x, t, 0, None, None, -100),
                 lambda x: F.cross_entropy(x, t, reduction="none"), [x], f32, "ce")
        x = (rand(37, 1013, dtype=f32, device=device) + 1e4).requires_grad_()
        loss = module.CrossEntropyFn.apply(x, t, 0, None, None, -100)
        x64 = x.detach().double().requires_grad_()
        ref = F.cross_entropy(x64, t, reduction="none")
        errs = [rel_err(loss, ref), rel_err(torch.autograd.grad(loss.sum(), x)[0],
                                            torch.autograd.grad(ref.sum(), x64)[0])]
        assert errs[0] < 2e-7 and errs[1] < 6e-7, f"ce relative error: loss {errs[0]:.2e} grad {errs[1]:.2e}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bug", list(MUTANTS))
def test_the_comparison_catches_planted_bugs(tmp_path, device, bug):
    name, old, new, message = MUTANTS[bug]
    _run_through(_load_kernel_copy(tmp_path, name, old, old), name, device)  # control: passes
    mutant = _load_kernel_copy(tmp_path, name, old, new)
    with pytest.raises(AssertionError, match=message):
        _run_through(mutant, name, device)
    if "square tiles only" in bug:  # why the rectangular cases exist: square tiles miss it
        _run_through(mutant, name, device, tiles=dict(fwd=(16, 16)))
