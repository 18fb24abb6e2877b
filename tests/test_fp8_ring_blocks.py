"""Block-scaled FP8 (blockwise, mxfp8) with --tp-comm-overlap: the rings' chunked GEMMs
(fp8_blocks.BlockRingGemms) make the casts the unchunked layer makes, so the overlapped FP8 MLP
gives plain SP's outputs and gradients bit for bit, even where dL/dW's tiles along the tokens are
longer than a ring chunk; and the verifier passes the whole model and fails a block plant."""
import pytest
import torch

from fp8_sp_mlp import fp8_sp_mlp, steps
from minitron.grid import ParallelConfig
from minitron.model import ModelConfig
from minitron.tensor_parallel.fp8 import FP8Recipe
from minitron.tensor_parallel.fp8_blocks import BlockRingGemms
from minitron.tensor_parallel.fp8_linear import SCALERS, named_fp8_states
from minitron.verify.run import verify


def _block_mlp_rank(overlapped: bool, recipe: str, block: int, chunked_wgrad: bool = False):
    """Two steps of the FP8 MLP under SP (fp8_sp_mlp.py) in blocks of `block`, an outlier feature
    in the input; returns the outputs, dL/dx, the gathered weight gradients and every scaler's
    (largest block scale, uses). chunked_wgrad: the planted ring casting dL/dW chunk by chunk."""
    BlockRingGemms.wgrad_whole = not chunked_wgrad     # the pool's processes outlive the test:
    try:                                               # restored below
        mlp, group, gen = fp8_sp_mlp(overlapped, FP8Recipe(recipe, block=block))
        out = steps(mlp, group, gen, outlier=True)
        scalers = {f"{layer}.{name}": (float(sc.last), sc.uses)
                   for layer, state in named_fp8_states(mlp).items()
                   for name, sc in zip(SCALERS, state.scalers())}
        return out, scalers
    finally:
        BlockRingGemms.wgrad_whole = True


def _differences(plain, ours) -> dict[str, float]:
    """{tensor: its largest |difference| / largest |plain value|} over ranks and steps."""
    worst = {}
    for (p_out, _), (o_out, _) in zip(plain, ours):
        for p, o in zip(p_out, o_out):
            for k in p:
                d = (o[k].float() - p[k].float()).abs().max() / p[k].float().abs().max()
                worst[k] = max(worst.get(k, 0.0), d.item())
    return worst


# block 4: a chunk holds whole tiles along the tokens; block 8: each such tile spans two chunks
@pytest.mark.parametrize("recipe,block", [("blockwise", 4), ("blockwise", 8), ("mxfp8", 8)])
def test_overlapped_block_fp8_equals_plain_sp_bitwise(run_ranks, recipe, block):
    plain = run_ranks(_block_mlp_rank, False, recipe, block, world_size=2)
    ours = run_ranks(_block_mlp_rank, True, recipe, block, world_size=2)
    for (p_out, p_scalers), (out, scalers) in zip(plain, ours):
        # every scaler cast as often and its latest cast's largest block scale the same
        assert scalers == p_scalers and len(scalers) == 6
        for p_step, step in zip(p_out, out):
            for k in step:
                # the same FP8 numbers in every GEMM, dL/dW one GEMM on the same gathered
                # operands, the other GEMMs cut by rows only, and tp=2's reduce-scatter a sum of
                # two (commutative): nothing may differ by a bit
                assert torch.equal(step[k], p_step[k]), (k, _differences(plain, ours))


def test_dw_tiles_cast_chunk_by_chunk_are_caught(run_ranks):
    """The test of the test, and why dL/dW runs after the ring: cast per chunk, a tile of 8
    tokens is cut into two of 4, each scaled by its own amax, and dL/dW leaves plain SP's
    (measured: dW1 4.7e-2, dW2 2.7e-2 of their largest entry; mxfp8 2.3e-2, 4.0e-2; with block 4,
    whole tiles per chunk, the chunked casts stay bitwise equal) while y and dx stay equal."""
    plain = run_ranks(_block_mlp_rank, False, "blockwise", 8, world_size=2)
    ours = run_ranks(_block_mlp_rank, True, "blockwise", 8, True, world_size=2)
    worst = _differences(plain, ours)
    assert worst["y"] == worst["dx"] == 0.0, worst
    assert min(worst["dW1"], worst["dW2"]) > 2 ** -8, worst


SMALL = dict(vocab_size=64, seq_len=8, hidden=32, n_layers=2, n_heads=4, dropout=0.1)


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_the_model_verifies_with_block_fp8_and_the_overlap_and_a_plant_fails(recipe):
    pcfg = ParallelConfig(tp=2, sequence_parallel=True, tp_comm_overlap=True)
    report = verify(pcfg, ModelConfig(**SMALL), 2, dtype=torch.bfloat16, fp8=FP8Recipe(recipe))
    assert report.passed, report.table()
    planted = verify(pcfg, ModelConfig(**SMALL), 1, dtype=torch.bfloat16, fp8=FP8Recipe(recipe),
                     plant="fp8-block-wrong-dim")
    assert not planted.passed, planted.table()
    assert any(r.quantity.startswith("fp8 scales") for r in planted.failures), planted.table()
