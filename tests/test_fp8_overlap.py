"""FP8 with --tp-comm-overlap: the rings' chunked GEMMs (overlap.py) cast with the scales the
unchunked FP8 layer takes (fp8_linear.FP8RingGemms), so the overlapped FP8 MLP gives the plain
SP FP8 MLP's outputs and gradients, and the verifier passes the whole model and fails a plant."""
import pytest
import torch

from fp8_sp_mlp import fp8_sp_mlp, steps
from minitron.grid import ParallelConfig
from minitron.model import ModelConfig
from minitron.tensor_parallel.fp8 import FP8Recipe
from minitron.tensor_parallel.fp8_linear import SCALERS, named_fp8_states
from minitron.verify.run import verify


def _fp8_mlp_rank(overlapped: bool, recipe: str):
    """Two steps of the FP8 MLP under SP (fp8_sp_mlp.py); returns the outputs, dL/dx, the gathered
    weight gradients and every scale a cast took, per layer and operand, in order."""
    mlp, group, gen = fp8_sp_mlp(overlapped, FP8Recipe(recipe))
    used = {}
    for layer, state in named_fp8_states(mlp).items():
        for name, scaler in zip(SCALERS, state.scalers()):
            def spy(x, scale_for=scaler.scale_for, key=f"{layer}.{name}"):
                s = scale_for(x)
                used.setdefault(key, []).append(s.clone())
                return s
            scaler.scale_for = spy
    # two steps: the second casts with the first one's history (delayed)
    return steps(mlp, group, gen), used


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_overlapped_fp8_equals_plain_sp_fp8(run_ranks, recipe):
    plain = run_ranks(_fp8_mlp_rank, False, recipe, world_size=2)
    ours = run_ranks(_fp8_mlp_rank, True, recipe, world_size=2)
    for (p_out, p_scales), (out, scales) in zip(plain, ours):
        assert scales.keys() == p_scales.keys() and len(scales) == 6
        for k in scales:                       # every cast used the unchunked layer's scale
            assert len(scales[k]) == len(p_scales[k]) == 2, k          # one per step: one use each
            assert all(torch.equal(a, b) for a, b in zip(scales[k], p_scales[k])), k
        for p_step, step in zip(p_out, out):
            for k in step:
                # the same FP8 numbers in every GEMM; only where float32 sums are cut into
                # chunks (dL/dW) could the last bf16 bit differ (measured: bitwise equal, on
                # AVX512 and under ATEN_CPU_CAPABILITY=default; the plant below moves 0.197)
                err = (step[k].float() - p_step[k].float()).abs().max() / p_step[k].float().abs().max()
                assert err <= 2 ** -8, (k, err.item())


def _chunk_amax_rank(overlapped, recipe):
    """The planted error: each rank's amax of its own chunk, not all-reduced."""
    import minitron.tensor_parallel.fp8 as fp8
    fp8.TensorScaler.amax_of = lambda self, x: fp8.amax(x)
    return _fp8_mlp_rank(overlapped, recipe)


def test_a_scale_taken_from_the_chunk_alone_is_caught(run_ranks):
    """The test of the test: without the amax reduction each rank scales by its own chunk's
    amax, and the outputs move by far more than the bar above."""
    plain = run_ranks(_fp8_mlp_rank, False, "current", world_size=2)
    ours = run_ranks(_chunk_amax_rank, True, "current", world_size=2)
    worst = max((o[k].float() - p[k].float()).abs().max().item() / p[k].float().abs().max().item()
                for (po, _), (oo, _) in zip(plain, ours) for p, o in zip(po, oo) for k in ("y", "dx"))
    assert worst > 4 * 2 ** -8, worst


SMALL = dict(vocab_size=64, seq_len=8, hidden=32, n_layers=2, n_heads=4, dropout=0.1)


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_the_model_verifies_in_fp8_with_the_overlap_and_its_plant_fails(recipe):
    pcfg = ParallelConfig(tp=2, sequence_parallel=True, tp_comm_overlap=True)
    report = verify(pcfg, ModelConfig(**SMALL), 2, dtype=torch.bfloat16, fp8=FP8Recipe(recipe))
    assert report.passed, report.table()
    assert min(r.tol / r.err for r in report.rows if r.tol and r.err) >= 2, report.table()
    planted = verify(pcfg, ModelConfig(**SMALL), 1, dtype=torch.bfloat16, fp8=FP8Recipe(recipe),
                     plant="fp8-unscaled")
    assert not planted.passed and max(r.err / r.tol for r in planted.failures) >= 3, planted.table()
