"""ParallelGPT(use_kernels=True) against the reference GPT, FusedAdamW against torch's AdamW.

The model checks run minitron.verify's per-rank body (logits, loss, dL/dX, every weight
gradient and every updated weight, at the verifier's tolerances), with the parallel side
stepping with FusedAdamW, and also record which ops took the Triton path, so a check cannot
pass by quietly running the torch twins.

Without a GPU per rank the kernels run in Triton's interpreter, which triton.jit picks when
triton and each kernel module are first imported. So, as in tests/test_kernels.py, triton is
imported here with TRITON_INTERPRET set (no GPU) and the variable removed again: the rest of the
suite, and the pool workers forked from pytest, run torch on the CPU. Each worker task here sets
it while it runs (ops reads it on every call) and restores it. Shapes are tiny: the interpreter
is slow. The test pool's ranks are gloo ranks on the CPU on every machine (tests/conftest.py), so
the model checks always need the interpreter. On a machine with a GPU this process imports triton
compiled, and the interpreter cannot run in it or in the ranks it forks: there the checks are
skipped in this process and run by test_cpu_rank_checks_in_a_process_without_gpus, which runs this
file again in a process that sees no GPU (strict, so that nothing in it may skip).
"""
import contextlib
import os
import subprocess
import sys

import torch

_SET_HERE = "TRITON_INTERPRET" not in os.environ
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.device_count() > 0 else "1")
INTERPRET = os.environ["TRITON_INTERPRET"] == "1"

import pytest  # noqa: E402

try:
    pytest.importorskip("triton")
finally:
    if _SET_HERE:
        del os.environ["TRITON_INTERPRET"]

from minitron.runtime import comm  # noqa: E402
from minitron.grid import ParallelConfig, build_grid  # noqa: E402
from minitron.kernels import ops  # noqa: E402
from minitron.model import GPT, ModelConfig, ParallelGPT  # noqa: E402
from minitron.model.fused import kernels_problem  # noqa: E402
from minitron.data_parallel.optim import FusedAdamW  # noqa: E402
from minitron.tensor_parallel.cross_entropy import (  # noqa: E402
    fused_vocab_parallel_cross_entropy, vocab_parallel_cross_entropy)
from minitron.verify import run_rank  # noqa: E402
from minitron.verify.checks import pattern  # noqa: E402

BASE = dict(vocab_size=64, seq_len=8, hidden=32, n_layers=2, n_heads=2, use_kernels=True)
LLAMA = dict(norm="rmsnorm", activation="swiglu", position="rope", bias=False)
CONFIGS = {
    # name: (tp, sequence_parallel, model options)
    "tp1-layernorm-gelu-bias-dropout": (1, False, dict(dropout=0.1)),
    "tp1-rmsnorm-swiglu-gqa-rope-tied": (1, False, dict(LLAMA, n_kv_heads=1, tie_embeddings=True)),
    "tp2-sp-layernorm-gelu-bias": (2, True, {}),
    "tp2-sp-layernorm-gelu-bias-dropout": (2, True, dict(dropout=0.1)),
    "tp2-layernorm-gelu-nobias-tied": (2, False, dict(bias=False, tie_embeddings=True)),
    "tp2-sp-rmsnorm-swiglu-gqa-rope": (2, True, dict(LLAMA, hidden=64, n_heads=4, n_kv_heads=2)),
    "tp2-sp-rmsnorm-swiglu-gqa-rope-dropout": (2, True, dict(LLAMA, hidden=64, n_heads=4,
                                                              n_kv_heads=2, dropout=0.1)),
}


def _configs(name):
    tp, sp, opts = CONFIGS[name]
    return ParallelConfig(tp=tp, sequence_parallel=sp), ModelConfig(**{**BASE, **opts})


NO_GPU_RUN = "run in a process that sees no GPU, by test_cpu_rank_checks_in_a_process_without_gpus"


def _skip_unless_cpu_ranks_can_run():
    """The pool's ranks run on the CPU (gloo) even where there are GPUs: the kernels need this
    process's triton to be interpreted, which it can be only on a machine without a GPU."""
    if torch.cuda.device_count() > 0 and not INTERPRET:
        pytest.skip(f"this process imported triton compiled for its GPU, and the pool's ranks run on "
                    f"the CPU: {NO_GPU_RUN}")
    os.environ["TRITON_INTERPRET"] = "1"   # what the worker will set, for the check only
    try:
        problem = kernels_problem(torch.device("cpu"))
    finally:
        if _SET_HERE:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = "1" if INTERPRET else "0"
    if problem:
        pytest.skip(f"ranks on the CPU, but {problem}")


def _expected_kernels(mcfg):
    """The ops a training step of this configuration must run as Triton kernels."""
    attention = "flash_attention" if mcfg.dropout == 0 else "scaled_masked_softmax"
    norm = "rms_norm" if mcfg.norm == "rmsnorm" else "layer_norm"
    mlp = {"swiglu"} if mcfg.activation == "swiglu" else {"bias_gelu"} if mcfg.bias else set()
    return {norm, attention, *mlp, "vocab_parallel_cross_entropy", "fused_adamw_step"}


@contextlib.contextmanager
def _kernels_env(pcfg, interpret=True):
    """In a pool worker: the interpreter on (CPU ranks only), and which ops took the Triton path."""
    saved = os.environ.get("TRITON_INTERPRET")
    if interpret and build_grid(pcfg).device.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    elif not interpret:
        os.environ.pop("TRITON_INTERPRET", None)
    used, real = set(), ops._triton_path

    def spy(t):   # ops calls this once per call to decide: record who asked, when it says yes
        if real(t):
            used.add(sys._getframe(1).f_code.co_name)
            return True
        return False

    ops._triton_path = spy
    try:
        yield used
    finally:
        ops._triton_path = real
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


def _compare_worker(name, bug=None):
    pcfg, mcfg = _configs(name)
    saved = ops.layer_norm, ops.flash_attention
    if bug == "norm eps":            # the kernel is handed a wrong epsilon
        ops.layer_norm = lambda x, w, b, eps=1e-5: saved[0](x, w, b, eps * 1e3)
    elif bug == "not causal":        # attention sees the future
        ops.flash_attention = lambda q, k, v, causal=True, scale=None: saved[1](q, k, v, False, scale)
    try:
        with _kernels_env(pcfg) as used:
            rows = run_rank(pcfg, mcfg, 2)
    finally:
        ops.layer_norm, ops.flash_attention = saved
    return rows, sorted(used)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_reference(run_ranks, name):
    pcfg, mcfg = _configs(name)
    _skip_unless_cpu_ranks_can_run()
    results = run_ranks(_compare_worker, name, world_size=pcfg.tp)
    rows = results[0][0]
    bad = [f"step {r.step} {r.quantity}: {r.err:.2e} > {r.tol:.0e}" for r in rows if not r.ok]
    assert not bad, "\n".join(bad)
    names = {pattern(n) for n in GPT(mcfg).state_dict()}
    for kind in ("grad", "weight"):      # every parameter compared, as a gradient and a weight
        assert {r.quantity.split(" ", 1)[1] for r in rows if r.quantity.startswith(kind)} == names
    assert {r.quantity for r in rows} >= {"logits", "loss", "dL/dX"}
    for used in (res[1] for res in results):   # and the kernels really ran, on every rank
        assert set(used) == _expected_kernels(mcfg), used


@pytest.mark.parametrize("bug,name,caught", [
    ("norm eps", "tp2-sp-layernorm-gelu-bias", "logits"),
    ("not causal", "tp2-sp-layernorm-gelu-bias", "logits"),
])
def test_planted_bug_is_caught(run_ranks, bug, name, caught):
    _skip_unless_cpu_ranks_can_run()
    rows = run_ranks(_compare_worker, name, bug, world_size=2)[0][0]
    row = {r.quantity: r for r in rows if r.step == 0}[caught]
    assert not row.ok and row.err > 100 * row.tol, f"{bug}: {caught} still matched ({row.err:.2e})"


# ---- the loss kernel: the same numbers in two all-reduces, where the torch path takes three ----
def _ce_worker():
    pcfg = ParallelConfig(tp=2)
    grid = build_grid(pcfg)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 64, generator=gen) * 3   # [b, s, V]; this rank keeps V/2
    targets = torch.randint(0, 64, (3, 5), generator=gen)
    out = {}
    with _kernels_env(pcfg) as used:
        for name, ce in (("torch", vocab_parallel_cross_entropy),
                         ("kernel", fused_vocab_parallel_cross_entropy)):
            shard = logits.chunk(2, dim=-1)[grid.tp.rank].clone().requires_grad_()
            with comm.counting() as c:
                loss = ce(shard, targets, grid.tp)
            loss.mean().backward()
            out[name] = (loss.detach(), shard.grad, c.calls(op="all_reduce"), c.bytes(op="all_reduce"))
    return out, sorted(used)


def test_fused_vocab_parallel_cross_entropy(run_ranks):
    _skip_unless_cpu_ranks_can_run()
    n = 3 * 5
    for out, used in run_ranks(_ce_worker, world_size=2):
        assert used == ["vocab_parallel_cross_entropy"]
        (loss, grad, calls, nbytes), (kloss, kgrad, kcalls, kbytes) = out["torch"], out["kernel"]
        torch.testing.assert_close(kloss, loss, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(kgrad, grad, rtol=1e-5, atol=1e-7)
        assert (calls, nbytes) == (3, 3 * n * 4)      # max, target logit, sum of exp
        assert (kcalls, kbytes) == (2, 3 * n * 4)     # max; [sum of exp; target logit] stacked


# ---- construction refuses what would silently run torch ---------------------------------------
def _errors_worker():
    pcfg = ParallelConfig(tp=2)
    grid = build_grid(pcfg)
    msgs = []
    for interpret, opts in ((False, {}), (True, dict(hidden=32, n_heads=4))):   # head_dim 8
        with _kernels_env(pcfg, interpret):
            try:
                ParallelGPT(ModelConfig(**{**BASE, **opts}), grid)
            except ValueError as e:
                msgs.append(str(e))
    return msgs, grid.device.type


def test_bad_kernel_setups_fail_at_construction(run_ranks):
    _skip_unless_cpu_ranks_can_run()
    msgs, device = run_ranks(_errors_worker, world_size=2)[0]
    if device == "cpu":
        assert "cpu tensors need a CUDA device or Triton's interpreter: set TRITON_INTERPRET=1 " \
               "in the environment before triton is first imported" in msgs.pop(0)
    assert len(msgs) == 1 and "flash attention takes head_dim in" in msgs[0]


def test_kernels_compiled_before_the_interpreter_was_set_are_named(monkeypatch):
    """A kernel module imported with the interpreter off cannot run CPU tensors: say which."""
    fake = type(sys)("minitron.kernels.fake")
    fake.kernel = type("JITFunction", (), {})()   # what triton.jit returns with it off
    monkeypatch.setitem(sys.modules, "minitron.kernels.fake", fake)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    problem = kernels_problem(torch.device("cpu"))
    assert "minitron.kernels.fake" in problem and "imported before TRITON_INTERPRET=1" in problem


# ---- FusedAdamW ---------------------------------------------------------------------------------
@pytest.fixture
def device(monkeypatch):
    """Where this process runs the kernels: its GPU, or its CPU through the interpreter."""
    if INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        return "cpu"
    if not torch.cuda.is_available():
        pytest.skip("no GPU, and triton was imported without the interpreter")
    return "cuda"


def _adamw_run(optimizer, device, **hp):
    """Four steps on random float32 parameters in two groups; returns (params, optimizer)."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(37,), (33, 65), (5, 7, 3)]     # 2145 elements: several kernel blocks and a tail
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in shapes]
    opt = optimizer([dict(params=params[:2]), dict(params=params[2:], lr=1e-2, weight_decay=0.0)],
                    **{**dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1), **hp})
    for _ in range(4):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(device)
        opt.step()
    return params, opt


def _adamw_mismatches(mine, ref):
    """Parameters and moments that differ by more than float32 rounding: a few ulps, of each
    element or, where the lerp cancels, of the largest (as in tests/test_kernels.py)."""
    (params, opt), (ref_params, ref_opt) = mine, ref
    bad = []
    for i, (p, r) in enumerate(zip(params, ref_params)):
        got, want = opt.state[p], ref_opt.state[r]
        assert got.keys() == want.keys() and got["step"].item() == want["step"].item() == 4
        for what, a, b in (("param", p, r), ("exp_avg", got["exp_avg"], want["exp_avg"]),
                           ("exp_avg_sq", got["exp_avg_sq"], want["exp_avg_sq"])):
            if not torch.allclose(a, b, rtol=4e-7, atol=2 ** -22 * b.abs().max().item()):
                bad.append(f"{what} {i}")
    return bad


def test_fused_adamw_matches_torch(device):
    ref = _adamw_run(lambda *a, **k: torch.optim.AdamW(*a, fused=False, foreach=False, **k), device)
    assert _adamw_mismatches(_adamw_run(FusedAdamW, device), ref) == []
    # the test of the test: a wrong beta2 changes every second moment, and the weights with it
    planted = _adamw_mismatches(_adamw_run(FusedAdamW, device, betas=(0.9, 0.9)), ref)
    assert {"param 0", "exp_avg_sq 0"} <= set(planted) and not any("exp_avg " in b for b in planted)


def test_fused_adamw_rejects_what_it_cannot_step():
    with pytest.raises(ValueError, match="keep fp32 master weights"):
        FusedAdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))])
    with pytest.raises(ValueError, match="betas"):
        FusedAdamW([torch.nn.Parameter(torch.zeros(3))], betas=(0.9, 1.0))


# ---- the command line -------------------------------------------------------------------------
def test_cli_kernels_passes():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}   # verify sets it
    run = subprocess.run([sys.executable, "-m", "minitron.verify", "--tp", "2", "--sp", "--kernels",
                          "--steps", "2", "--hidden", "32", "--heads", "2", "--seq", "8",
                          "--vocab", "64"], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.strip().splitlines()
    assert "use_kernels=True" in lines[1]
    if not torch.cuda.is_available():
        assert lines[3].startswith("kernels=Triton interpreter on the CPU (TRITON_INTERPRET=1")
    assert lines[-1].startswith("PASS max_rel_err=")
    rows = [line for line in lines if line.split()[0] in ("0", "1")]
    assert {line.split()[0] for line in rows} == {"0", "1"} and all(r.endswith("yes") for r in rows)


def test_cli_kernels_rejects_float64(capsys):
    from minitron.verify import cli as verify_cli
    assert verify_cli.main(["--tp", "2", "--kernels", "--dtype", "float64"]) == 2
    assert "use --dtype float32" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.device_count() == 0 or INTERPRET,
                    reason="needs a GPU (without one, the pool's checks run in this process)")
def test_cpu_rank_checks_in_a_process_without_gpus():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "MINITRON_STRICT": "1"}
    env.pop("TRITON_INTERPRET", None)     # tests/conftest.py sets it, seeing no GPU
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                          "-k", "not without_gpus"], capture_output=True, text=True, timeout=1800, env=env)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " skipped" not in run.stdout, run.stdout[-2000:]
