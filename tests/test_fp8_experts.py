"""FP8 experts (minitron/tensor_parallel/fp8_batched.py): the grouped GEMM is the dense FP8 linear
expert by expert, bit for bit (all four recipes); blockwise and mxfp8 experts are a hand
quantizer's casts, bit for bit; a split with experts passes the FP8 verdict against one device
(ep alone, ep with dp, ep with tp+SP, ZeRO-3, a pipeline, every recipe); a fault in the experts'
casts fails it; the experts' scalers travel in a checkpoint, and a resumed run continues bit for
bit. Small shapes and two steps keep it fast: `python -m minitron.verify --tp 1 --ep 2
--experts 4 --dtype fp8 [--fp8-recipe blockwise] [--plant fp8-experts-...]` runs the same at
the default shape."""
import math

import pytest
import torch

from minitron.grid import ParallelConfig
from minitron.model import ModelConfig
from minitron.tensor_parallel.fp8 import BLOCK_RECIPES, FP8Recipe
from minitron.tensor_parallel.fp8_batched import ExpertStates, expert_linear, grouped_fp8
from minitron.tensor_parallel.fp8_linear import FP8State, ScaleTape, fp8_linear, named_fp8_states
from minitron.train.engine import TrainingRun
from minitron.verify import Report, run_rank

import resumed_run

SMALL = dict(vocab_size=64, seq_len=8, hidden=32, n_layers=2, n_heads=4, dropout=0.1, n_experts=4)
GRIDS = {"ep2": ParallelConfig(ep=2), "ep2-dp2": ParallelConfig(ep=2, dp=2),
         "ep2-tp2-sp": ParallelConfig(ep=2, tp=2, sequence_parallel=True)}


# ---- the grouped GEMM: the dense FP8 linear, expert by expert -------------------------------
def _loop_and_group(recipe: str, counts, steps=3):
    """grouped_fp8 (plus bias) against the dense fp8_linear, each expert with a dense FP8State of
    its own, on each expert's rows, over `steps` uses: what differs, and both sets of scalers."""
    gen = torch.Generator().manual_seed(0)
    e, c, k, n = len(counts), max(counts), 32, 48
    w = (torch.randn(e, n, k, generator=gen) * 0.02).bfloat16()
    b = (torch.randn(e, n, generator=gen) * 0.02).bfloat16()
    grouped = ExpertStates(_recipe(recipe), range(e))
    looped = [FP8State(_recipe(recipe)) for _ in counts]
    differ = []
    for step in range(steps):
        x = torch.randn(e, c, k, generator=gen).bfloat16() * (1 + step)
        dy = torch.randn(e, c, n, generator=gen).bfloat16()
        for i, m in enumerate(counts):
            x[i, m:], dy[i, m:] = 0, 0
        xg, wg = _rows(x, counts).requires_grad_(), w.clone().requires_grad_()
        y = grouped_fp8(xg, wg, counts, grouped.local())
        y.backward(_rows(dy, counts))
        y, xg_grad = _padded(y, counts, c) + b[:, None, :], _padded(xg.grad, counts, c)
        for i, m in enumerate(counts):
            if not m:        # the dense linear takes no empty input; the group gives it nothing
                differ += [bool(wg.grad[i].any()), bool(xg_grad[i].any())]
                continue
            xl, wl = x[i, :m].clone().requires_grad_(), w[i].clone().requires_grad_()
            yl = looped[i].linear(xl, wl, b[i])           # fp8_linear, or fp8_blocks' block_linear
            yl.backward(dy[i, :m])
            differ += [not torch.equal(y[i, :m], yl), not torch.equal(xg_grad[i, :m], xl.grad),
                       not torch.equal(wg.grad[i], wl.grad)]
    return differ, grouped, looped


def _rows(x: torch.Tensor, counts) -> torch.Tensor:
    """The group's input from a padded [E, c, ...]: each expert's first counts[e] rows, in order."""
    return torch.cat([x[e, :m] for e, m in enumerate(counts)])


def _padded(rows: torch.Tensor, counts, c: int) -> torch.Tensor:
    """[E, c, ...] from the group's rows, zeros below each expert's counts[e]."""
    out = rows.new_zeros(len(counts), c, *rows.shape[1:])
    for e, block in enumerate(rows.split(list(counts))):
        out[e, :block.shape[0]] = block
    return out


def _recipe(scaling: str) -> FP8Recipe:
    """Blocks of 8 for the fine-grained recipes: several blocks along every dimension here."""
    return FP8Recipe(scaling, block=8 if scaling in BLOCK_RECIPES else None)


@pytest.mark.parametrize("recipe", ["delayed", "current", "blockwise", "mxfp8"])
@pytest.mark.parametrize("counts", [[5, 0, 7], [3, 3], [1]])
def test_the_grouped_gemm_is_the_dense_fp8_linear_expert_by_expert(recipe, counts):
    differ, grouped, looped = _loop_and_group(recipe, counts)
    assert differ and not any(differ)
    for m, a, b in zip(counts, grouped.local(), looped):     # the same histories, scales, uses
        for sa, sb in zip(a.scalers(), b.scalers()):
            if m:
                assert sa.uses == sb.uses and torch.equal(sa.last, sb.last)
                assert sa.history is None or torch.equal(sa.history, sb.history)


# ---- the fine-grained group against a hand quantizer ----------------------------------------
def _hand_cast(x: torch.Tensor, rows: int, cols: int, pow2: bool) -> torch.Tensor:
    """x cast to E4M3 block by block, written out loop by loop (DeepSeek-V3 §3.3.2; MX v1.0
    §6.3), dequantized as a GEMM's scale-inverse does: q * (1/s), float32."""
    out = torch.empty(x.shape)
    for i in range(0, x.shape[0], rows):
        for j in range(0, x.shape[1], cols):
            blk = x[i:i + rows, j:j + cols].float()
            a = float(blk.abs().max())
            if a == 0:
                s = torch.tensor(1.0)
            elif pow2:                                  # E8M0: 2^(emax_elem - floor(log2 amax))
                s = torch.tensor(2.0 ** (8 - math.floor(math.log2(a))))
            else:                                       # 448 / amax, float32, correctly rounded
                s = torch.tensor(448.0) / torch.tensor(a)
            q = (blk * s).clamp(-448, 448).to(torch.float8_e4m3fn)
            out[i:i + rows, j:j + cols] = q.float() * (torch.tensor(1.0) / s)
    return out


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_the_fine_grained_group_is_the_hand_quantizer(recipe):
    """y, dx and dW of every expert: the hand-cast operands multiplied in float32 (the promotion
    every block of K, with nothing narrower in between), bit for bit; an outlier token, and an
    expert without tokens. A per-tensor cast of the same x gives another y (the check can fail)."""
    b, mx = 8, recipe == "mxfp8"
    gen = torch.Generator().manual_seed(1)
    counts, (c, k, n) = [6, 0, 11], (11, 24, 16)
    x = torch.randn(3, c, k, generator=gen).bfloat16()
    x[0, 2, 5] = 300                                              # an outlier
    w = (torch.randn(3, n, k, generator=gen) * 0.05).bfloat16()
    dy = torch.randn(3, c, n, generator=gen).bfloat16()
    for e, m in enumerate(counts):
        x[e, m:], dy[e, m:] = 0, 0
    xg, wg = _rows(x, counts).requires_grad_(), w.clone().requires_grad_()
    y = grouped_fp8(xg, wg, counts, ExpertStates(FP8Recipe(recipe, block=b), range(3)).local())
    y.backward(_rows(dy, counts))
    y, dx = _padded(y, counts, c), _padded(xg.grad, counts, c)
    bf = torch.bfloat16
    for e, m in enumerate(counts):
        if not m:
            assert not y[e].any() and not dx[e].any() and not wg.grad[e].any()
            continue
        xe, ge = x[e, :m], dy[e, :m]
        hw = _hand_cast(w[e], 1 if mx else b, b, mx)
        hw_dgrad = _hand_cast(w[e], b, 1, mx) if mx else hw
        assert torch.equal(y[e, :m], (_hand_cast(xe, 1, b, mx) @ hw.t()).to(bf))
        assert torch.equal(dx[e, :m], (_hand_cast(ge, 1, b, mx) @ hw_dgrad).to(bf))
        assert torch.equal(wg.grad[e], (_hand_cast(ge, b, 1, mx).t() @ _hand_cast(xe, b, 1, mx)).to(bf))
    per_tensor = (_hand_cast(x[0, :6], 6, k, mx) @ _hand_cast(w[0], n, k, mx).t()).to(bf)
    assert not torch.equal(y[0, :6], per_tensor)


def test_the_reference_expert_is_the_dense_fp8_linear():
    """expert_linear (moe/reference.py's loop): fp8_linear itself on a CPU; an expert without
    tokens still counts the use, with amax 0, as the group does."""
    x, w = torch.randn(5, 32).bfloat16(), torch.randn(48, 32).bfloat16()
    mine, dense = ExpertStates(FP8Recipe("delayed"), range(1)).local()[0], FP8State(FP8Recipe("delayed"))
    assert torch.equal(expert_linear(x, w, None, mine), fp8_linear(x, w, None, dense))
    empty = x[:0].clone().requires_grad_()
    expert_linear(empty, w, None, mine).sum().backward()
    assert mine.input.uses == 2 and mine.input.history[1] == 0 and mine.grad.uses == 1


def test_a_rerun_replays_the_scales_of_the_first_forward():
    """Recomputation (fp8_linear.ScaleTape): the rerun casts as the first forward did, and no
    amax is recorded twice."""
    states = ExpertStates(FP8Recipe("delayed"), range(2))
    x, w = torch.randn(8, 16).bfloat16(), torch.randn(2, 8, 16).bfloat16()
    grouped_fp8(x, w, [4, 4], states.local())                      # a history to start from
    tape = ScaleTape()
    with tape.recording():
        first = grouped_fp8(3 * x, w, [4, 4], states.local())
    uses = [st.input.uses for st in states.local()]
    with tape.replay():
        again = grouped_fp8(3 * x, w, [4, 4], states.local())
    assert torch.equal(first, again) and uses == [st.input.uses for st in states.local()]
    assert not torch.equal(first, grouped_fp8(3 * x, w, [4, 4], states.local()))   # the next use: new scales


def test_each_expert_has_its_own_scale():
    """Experts of different magnitudes: one scale over the group would not be each expert's."""
    states = ExpertStates(FP8Recipe("current"), range(2))
    x = torch.ones(8, 16, dtype=torch.bfloat16)
    x[4:] *= 8
    grouped_fp8(x, torch.ones(2, 8, 16, dtype=torch.bfloat16), [4, 4], states.local())
    s0, s1 = (st.input.last for st in states.local())
    assert torch.equal(s0, 8 * s1)


def test_an_expert_without_tokens_keeps_its_scale_and_counts_the_use():
    states = ExpertStates(FP8Recipe("delayed"), range(2))
    x = torch.randn(8, 16).bfloat16()
    w = torch.randn(2, 8, 16).bfloat16()
    grouped_fp8(x, w, [4, 4], states.local())
    before = states.local()[1].input.scale.clone()
    grouped_fp8(x[:4], w, [4, 0], states.local())
    idle = states.local()[1].input
    assert idle.uses == 2 and torch.equal(idle.last, before) and idle.history[1] == 0


# ---- the split against one device ------------------------------------------------------------
def _report(run_ranks, grid, recipe="delayed", plant=None, steps=2, zero=None, schedule=None,
            mcfg=None, pcfg=None, batch=4):
    pcfg = pcfg or GRIDS[grid]
    rows = run_ranks(run_rank, pcfg, mcfg or ModelConfig(**SMALL), steps, torch.bfloat16, 0, 1e-4, 1e-6,
                     batch, None, plant, schedule, zero, world_size=pcfg.world_size,
                     fp8=_recipe(recipe))[0]
    return Report(rows)


def _expert_scales_compared(report) -> bool:
    return any(r.quantity == "fp8 scales (log2)" for r in report.rows)


@pytest.mark.parametrize("recipe", ["delayed", "current"])
@pytest.mark.parametrize("grid", list(GRIDS))
def test_fp8_experts_pass_against_one_device(run_ranks, grid, recipe):
    report = _report(run_ranks, grid, recipe)
    assert report.passed, report.table()
    assert _expert_scales_compared(report)
    # issue 30's bar for every correct low-precision run: 3x (the twins' noise is the unit)
    assert min(r.tol / r.err for r in report.rows if r.tol and r.err) >= 3, report.table()


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
@pytest.mark.parametrize("grid", ["ep2", "ep2-tp2-sp"])
def test_fine_grained_experts_pass_against_one_device(run_ranks, grid, recipe):
    report = _report(run_ranks, grid, recipe)
    assert report.passed, report.table()
    assert _expert_scales_compared(report)
    assert (recipe == "mxfp8") == any("powers of 2" in r.quantity for r in report.rows)
    # 3x (issue 30): ep2 x tp2+SP, mxfp8, passed by 2.5x while an expert's token-blocked largest
    # block scale was compared (another cast there: fp8_rows._judged); now 4.5x, blockwise 3.3x
    assert min(r.tol / r.err for r in report.rows if r.tol and r.err) >= 3, report.table()


@pytest.mark.parametrize("plant,recipe", [
    ("fp8-experts-unscaled", "blockwise"), ("fp8-experts-unscaled", "mxfp8"),
    ("fp8-experts-e5m2-forward", "blockwise"),
    ("fp8-experts-e5m2-forward", "mxfp8")])
def test_a_fault_in_the_fine_grained_experts_casts_fails(run_ranks, plant, recipe):
    """Unscaled fails by 15x (blockwise) and 19x (mxfp8) at its worst row; E5M2 in the forward,
    one mantissa bit, on the scale row: each tensor's smallest block scale (its amax's, which the
    twins move by roundings) sits 7 binades (57344 / 448) off one device's. The largest block
    scale alone, which the twins move by binades, missed it under blockwise."""
    report = _report(run_ranks, "ep2", recipe, plant=plant)
    assert not report.passed
    worst = max(r.err / r.tol for r in report.failures if r.tol)
    assert worst >= 3, report.table()
    assert any("mlp.experts." in r.quantity or "mlp.experts." in r.detail for r in report.failures)


SWIGLU = ModelConfig(**{**SMALL, "activation": "swiglu", "norm": "rmsnorm"})


def test_fp8_experts_pass_with_zero3_and_swiglu(run_ranks):
    report = _report(run_ranks, None, zero=3, mcfg=SWIGLU, pcfg=ParallelConfig(ep=2, dp=2))
    assert report.passed, report.table()


def test_fp8_experts_pass_in_a_pipeline(run_ranks):
    """Micro-batch by micro-batch on both sides (the amaxes are per micro-batch)."""
    report = _report(run_ranks, None, pcfg=ParallelConfig(ep=2, pp=2), schedule="1f1b", batch=8)
    assert report.passed, report.table()
    assert _expert_scales_compared(report)


@pytest.mark.parametrize("plant", ["fp8-experts-e5m2-forward", "fp8-experts-unscaled"])
def test_a_fault_in_the_experts_casts_fails(run_ranks, plant):
    report = _report(run_ranks, "ep2", plant=plant)
    assert not report.passed
    scales = [r for r in report.failures if r.quantity == "fp8 scales (log2)"]
    assert scales and min(r.err / r.tol for r in scales) >= 3, report.table()
    assert "mlp.experts." in scales[0].detail              # an expert's scaler is the worst


# ---- checkpoints ------------------------------------------------------------------------------
def _train(total, path=None, save_at=None):
    from minitron.train import checkpoint
    run = TrainingRun(ModelConfig(**SMALL), ParallelConfig(ep=2, dp=2), zero_stage=1, dtype=torch.bfloat16,
                      lr=1e-2, fp8=FP8Recipe("delayed", history_len=4))
    losses = resumed_run.train(run, total, path, save_at)
    states = named_fp8_states(run.model)
    return losses, {n: [st.history.clone() for st in s.scalers()] for n, s in states.items()}, \
        sorted(checkpoint.fp8_states_of_every_stage(run.model))


def test_an_fp8_run_with_experts_resumes_bit_for_bit(run_ranks, tmp_path):
    path = str(tmp_path / "fp8")
    full, full_hist, saved = run_ranks(_train, 6, world_size=4)[0]
    assert sum(".experts.fc1." in n for n in saved) == 2 * 4          # 2 layers, every expert
    first, _, _ = run_ranks(_train, 3, path, 3, world_size=4)[0]
    rest, rest_hist, _ = run_ranks(_train, 6, path, world_size=4)[0]
    assert first + rest == full                                     # exactly, on CPU
    assert full_hist.keys() == rest_hist.keys()
    assert all(torch.equal(a, b) for n in full_hist for a, b in zip(full_hist[n], rest_hist[n]))
