"""FP8 training (minitron/tensor_parallel/fp8.py, fp8_linear.py): the casts against a hand
computation of the formats, saturation, the delayed-scaling scale update, the FP8 linear's
forward and backward against the same GEMMs on dequantized operands, verify --dtype fp8 (both
recipes pass against one device running the same FP8 GEMMs, the planted recipe faults fail),
and an FP8 run resumed from a checkpoint continuing bit for bit."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from minitron.grid import ParallelConfig, build_grid
from minitron.model import ModelConfig, ParallelGPT
from minitron.pipeline.schedules import make_schedule
from minitron.tensor_parallel.fp8 import (E4M3, E5M2, FP8Recipe, TensorScaler, delayed_scale,
                                          dequantize, quantize, scale_from_amax, tolerance_fp8)
from minitron.tensor_parallel.fp8_linear import FP8State, enable_fp8, fp8_linear, fp8_states, scaled_matmul
from minitron.train.engine import TrainingRun, check_supported
from minitron.train.precision import resolve_precision
from minitron.verify import verify

import resumed_run

# (mantissa bits, smallest normal exponent, largest value) read off the bit layouts
LAYOUT = {E4M3: (3, -6, 448.0), E5M2: (2, -14, 57344.0)}


def by_hand(x: torch.Tensor, fmt) -> torch.Tensor:
    """Round to the format from its layout: spacing 2^(e - m) in [2^e, 2^(e+1)), never finer
    than the subnormals' 2^(emin - m); ties to even; saturate at the largest value."""
    m, emin, big = LAYOUT[fmt]
    x = x.double().clamp(-big, big)
    e = torch.floor(torch.log2(x.abs().clamp(min=2.0 ** emin)))
    spacing = 2.0 ** (e - m)
    return torch.round(x / spacing) * spacing          # torch.round: half to even


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_cast_is_the_format_by_hand(fmt):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4000, generator=gen, dtype=torch.float64) * torch.exp2(
        torch.randint(-18, 17, (4000,), generator=gen).double())
    one = torch.ones((), dtype=torch.float32)
    got = quantize(x.float(), one, fmt).double()
    assert torch.equal(got, by_hand(x.float(), fmt))


def test_hand_values_and_saturation():
    one = torch.ones(())
    vals = torch.tensor([0.2, 0.3, 1000.0, -1e6, 2.0 ** -10])
    assert quantize(vals, one, E4M3).float().tolist() == [0.203125, 0.3125, 448.0, -448.0, 0.0]
    assert quantize(vals, one, E5M2).float().tolist() == [0.1875, 0.3125, 1024.0, -57344.0, 2.0 ** -10]
    # a scale brings a small tensor up to the format's range and dequantize undoes it
    x = torch.tensor([0.01, -0.02, 0.0005])
    s = scale_from_amax(x.abs().max(), E4M3)
    assert float(s) == pytest.approx(448 / 0.02)
    assert torch.allclose(dequantize(quantize(x, s, E4M3), s), x, rtol=2 ** -4)


def test_delayed_scale_from_history():
    hist = torch.tensor([1.0, 4.0, 2.0])
    assert float(delayed_scale(hist, E4M3)) == 112.0                       # 448 / max
    assert float(delayed_scale(hist, E4M3, margin=1)) == 56.0
    assert float(delayed_scale(hist, E5M2)) == 57344.0 / 4
    prev = torch.tensor(3.0)
    assert float(delayed_scale(torch.zeros(3), E4M3, previous=prev)) == 3.0   # no amax yet
    assert float(scale_from_amax(torch.tensor(math.inf), E4M3, previous=prev)) == 3.0


def test_scaler_window_over_uses():
    """history_len 2: each use is cast with the scale of the uses before it; a spike (8) is
    cast too small (saturates), then keeps the scale small until it leaves the window."""
    scaler = TensorScaler(E4M3, FP8Recipe("delayed", history_len=2))
    got = [float(scaler.scale_for(torch.tensor([a]))) for a in (2.0, 8.0, 1.0, 1.0, 1.0)]
    assert got == [224.0, 224.0, 56.0, 56.0, 448.0]
    current = TensorScaler(E4M3, FP8Recipe("current"))
    assert [float(current.scale_for(torch.tensor([a]))) for a in (2.0, 8.0)] == [224.0, 56.0]


def test_fp8_linear_is_the_gemm_of_dequantized_operands():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 8, 32, generator=gen).requires_grad_()
    w = (torch.randn(16, 32, generator=gen) * 0.02).requires_grad_()
    b = torch.randn(16, generator=gen).requires_grad_()
    dy = torch.randn(2, 8, 16, generator=gen) * 1e-4
    y = fp8_linear(x, w, b, FP8State(FP8Recipe("current")))
    y.backward(dy)

    def qdq(t, fmt):          # the cast current scaling makes, widened back
        s = 448.0 / t.abs().max() if fmt == E4M3 else 57344.0 / t.abs().max()
        return dequantize(quantize(t, s, fmt), s).double()
    xq, wq, gq = qdq(x.detach(), E4M3), qdq(w.detach(), E4M3), qdq(dy, E5M2)
    assert torch.allclose(y.double(), F.linear(xq, wq, b.double()), rtol=1e-5, atol=1e-6)
    assert torch.allclose(x.grad.double(), gq @ wq, rtol=1e-5, atol=1e-12)
    assert torch.allclose(w.grad.double(), gq.flatten(0, 1).t() @ xq.flatten(0, 1), rtol=1e-5, atol=1e-12)
    assert torch.equal(b.grad, dy.sum((0, 1)))        # the bias gradient is not quantized
    # and it differs from the float32 linear by FP8's rounding, not by less
    err = (y - F.linear(x, w, b)).abs().max() / F.linear(x, w, b).abs().max()
    assert 2 ** -9 < err < tolerance_fp8(forward=True)


def test_first_and_last_layers_stay_bf16():
    grid = build_grid(ParallelConfig(tp=1))
    model = ParallelGPT(ModelConfig(vocab_size=64, seq_len=8, n_layers=2), grid).bfloat16()
    names = enable_fp8(model, FP8Recipe())
    assert names == [f"layers.{i}.{n}" for i in range(2)
                     for n in ("attention.qkv", "attention.out", "mlp.fc1", "mlp.fc2")]
    assert getattr(model.lm_head, "fp8", None) is None


def test_engine_refuses_what_fp8_does_not_run():
    dtype, recipe = resolve_precision("fp8", "current")
    assert (dtype, recipe) == (torch.bfloat16, FP8Recipe("current"))
    pcfg, mcfg = ParallelConfig(tp=1, pp=2), ModelConfig()
    with pytest.raises(ValueError, match="inside bfloat16"):
        check_supported(ParallelConfig(tp=1), mcfg, torch.float16, None, None, recipe)
    check_supported(pcfg, mcfg, dtype, None, make_schedule("zb-h1", 2, 4), recipe)   # runs now
    check_supported(ParallelConfig(tp=1), ModelConfig(recompute="full"), dtype, None, None,
                    FP8Recipe("delayed"))                                   # runs now
    check_supported(pcfg, mcfg, dtype, None, make_schedule("1f1b", 2, 4), recipe)   # runs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch._scaled_mm)")
def test_scaled_mm_matches_the_emulation():
    from minitron.tensor_parallel.fp8_linear import gpu_has_fp8
    if not gpu_has_fp8(torch.device("cuda")):
        pytest.skip("needs a CUDA GPU with FP8 tensor cores (compute capability 8.9+)")
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randn(64, 128, generator=gen), torch.randn(128, 32, generator=gen)
    sa, sb = 448.0 / a.abs().max(), 448.0 / b.abs().max()
    qa, qb = quantize(a, sa, E4M3), quantize(b, sb, E4M3)
    cpu = scaled_matmul(qa, sa, qb, sb, torch.float32)
    gpu = scaled_matmul(qa.cuda(), sa.cuda(), qb.cuda(), sb.cuda(), torch.float32).cpu()
    assert torch.allclose(gpu, cpu, rtol=1e-5, atol=1e-5 * cpu.abs().max().item())


SMALL = dict(vocab_size=64, seq_len=8, hidden=32, n_heads=2, dropout=0.1)


@pytest.mark.parametrize("tp,sp,recipe", [(2, True, "delayed"), (2, True, "current"), (1, False, "current")])
def test_verify_fp8_passes_against_one_device_in_fp8(tp, sp, recipe):
    """The reference runs the same FP8 GEMMs (fused qkv, one scale each); with the amaxes
    reduced over tp every cast uses one device's scale."""
    report = verify(ParallelConfig(tp=tp, sequence_parallel=sp), ModelConfig(**SMALL), 2,
                    dtype=torch.bfloat16, fp8=FP8Recipe(recipe))
    assert report.passed, report.table()
    scales = [r for r in report.rows if r.quantity.startswith("fp8 scales")]
    assert len(scales) == 2
    if tp == 1:        # nothing is split: the same casts, the same numbers
        assert all(r.err == 0 for r in scales), report.table()
    else:              # rounding noise is there (the check is not vacuous), inside its bar
        assert max(r.err for r in report.rows if r.quantity == "logits") > 2 ** -10
        assert min(r.tol / r.err for r in report.rows if r.tol and r.err) >= 3, report.table()


FP8_PLANTS = [("fp8-stale-amax", "delayed"), ("fp8-double-scale", "current"), ("fp8-unscaled", "current"),
              ("fp8-unscaled", "delayed"), ("fp8-e5m2-forward", "delayed"), ("fp8-wrong-amax", "current")]


@pytest.mark.parametrize("plant,recipe", FP8_PLANTS)
def test_verify_fp8_catches_a_broken_recipe(plant, recipe):
    report = verify(ParallelConfig(tp=2, sequence_parallel=True), ModelConfig(**SMALL), 1,
                    dtype=torch.bfloat16, fp8=FP8Recipe(recipe), plant=plant)
    assert not report.passed
    worst = max(r.err / r.tol for r in report.failures)
    assert worst >= 3, report.table()


def test_a_scale_stays_finite_for_any_amax():
    tiny, zero = torch.tensor(1e-38), torch.tensor(0.0)
    for fmt in (E4M3, E5M2):
        s = scale_from_amax(tiny, fmt)
        assert torch.isfinite(s) and s > 0
        q = quantize(torch.full((4,), 1e-38), s, fmt)
        assert torch.isfinite(dequantize(q, s)).all()
        assert scale_from_amax(zero, fmt) == 1.0                   # nothing to scale: keep 1
        assert scale_from_amax(zero, fmt, previous=torch.tensor(8.0)) == 8.0
    for recipe in ("delayed", "current"):
        scaler = TensorScaler(E4M3, FP8Recipe(recipe))
        for x in (torch.zeros(3), torch.full((3,), 1e-38), torch.ones(3)):
            assert torch.isfinite(scaler.scale_for(x))


def test_bench_precision_writes_its_csv_and_figure(tmp_path):
    from minitron.bench.precision import run
    csv, png = tmp_path / "p.csv", tmp_path / "p.png"
    assert run(["--steps", "3", "--tail", "2", "--hidden", "32", "--seq", "16", "--batch", "4",
                "--csv", str(csv), "--figure", str(png)]) == 0
    lines = csv.read_text().splitlines()
    assert lines[0].startswith("# date: ") and lines[1].startswith("# command: python -m minitron.bench precision")
    assert lines[3] == ("step,float32,bfloat16,fp8_delayed,fp8_current,fp8_blockwise,fp8_mxfp8,"
                        "bfloat16_nudged_1,bfloat16_nudged_2,bfloat16_nudged_3") and len(lines) == 4 + 3
    first = [float(v) for v in lines[4].split(",")[1:]]
    assert max(first) - min(first) < 0.02 * first[0]     # one start, every precision and nudge
    assert png.stat().st_size > 0


@pytest.mark.parametrize("argv,says", [
    (["--fp8-recipe", "current"], "add --dtype fp8"),
    (["--dtype", "fp8", "--fp8-recipe", "current", "--plant", "fp8-stale-amax"], "--fp8-recipe delayed"),
    (["--plant", "fp8-double-scale"], "add --dtype fp8"),
])
def test_verify_cli_refuses_before_any_rank_starts(argv, says, capsys):
    from minitron.verify.cli import main
    assert main(argv) == 2
    assert says in capsys.readouterr().err


# ---- checkpoints: an FP8 run resumed continues bit for bit --------------------------------------
CKPT_MCFG = ModelConfig(vocab_size=64, seq_len=8, hidden=32, n_layers=2, n_heads=2, dropout=0.1)


def _fp8_run():
    return TrainingRun(CKPT_MCFG, ParallelConfig(tp=2, sequence_parallel=True, dp=2), zero_stage=1,
                       dtype=torch.bfloat16, lr=1e-2, fp8=FP8Recipe("delayed", history_len=4))


def _fp8_train(total, path=None, save_at=None):
    run = _fp8_run()
    losses = resumed_run.train(run, total, path, save_at)
    histories = [st.history.clone() for state in fp8_states(run.model) for st in state.scalers()]
    return losses, histories


def test_an_fp8_run_resumes_bit_for_bit(run_ranks, tmp_path):
    """The amax histories and scales are in the checkpoint: the resumed run casts with the scales
    the uninterrupted one would (delayed scaling, a window of 4 uses: 6 steps fill it)."""
    path = str(tmp_path / "fp8")
    full, full_hist = run_ranks(_fp8_train, 6, world_size=4)[0]
    first, _ = run_ranks(_fp8_train, 3, path, 3, world_size=4)[0]
    rest, rest_hist = run_ranks(_fp8_train, 6, path, world_size=4)[0]
    assert first + rest == full                                   # exactly, on CPU
    assert all(torch.equal(a, b) for a, b in zip(rest_hist, full_hist))


def _resume_without_fp8_state(total, path):
    from minitron.train import checkpoint
    real, checkpoint.load_fp8 = checkpoint.load_fp8, lambda model, saved, path: None
    try:                        # the pool's ranks outlive this test: put it back
        return _fp8_train(total, path)
    finally:
        checkpoint.load_fp8 = real


def test_without_the_scalers_state_the_resumed_run_differs(run_ranks, tmp_path):
    """The test above can fail: a resume that drops the histories casts with other scales."""
    path = str(tmp_path / "fp8")
    full, _ = run_ranks(_fp8_train, 6, world_size=4)[0]
    first, _ = run_ranks(_fp8_train, 3, path, 3, world_size=4)[0]
    rest, _ = run_ranks(_resume_without_fp8_state, 6, path, world_size=4)[0]
    assert first + rest != full
