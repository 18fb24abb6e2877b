"""Context-parallel attention against full attention on one device, through autograd.

Every rank builds the same q, k, v and output gradient, keeps its tokens (zigzag or
contiguous chunks), runs one of the three variants, and the outputs and dQ, dK, dV gathered
back in order are compared with full attention on the whole sequence (float64: tolerance
1e-12, measured ~1e-15; the Triton kernel's float32 blocks: 1e-5, measured ~4e-7). A planted
merge without rescaling is caught. Then the measured figures: saved activations per rank
fall as 1/cp, the ring's bytes equal the formula, the balanced split's work is even.
"""
import contextlib
import os

import pytest
import torch

from minitron.runtime import comm
from minitron.context_parallel import (VARIANTS, attention_flops_per_rank, chunk_ids,
                                       context_parallel_attention, imbalance, positions,
                                       ring_bytes, scores_per_rank, shard_sequence,
                                       unshard_sequence)
from minitron.verify.plants_context_parallel import merged_without_rescale
from minitron.context_parallel.measure import PeakBytes, saved_bytes
from minitron.context_parallel.ulysses import torch_attention
from minitron.grid import ParallelConfig, build_grid
from minitron.verify.compare import rel_err

TOL64 = 1e-12


def _tensors(b, hq, hkv, s, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, s, d, generator=g, dtype=dtype)
    k = torch.randn(b, hkv, s, d, generator=g, dtype=dtype)
    v = torch.randn(b, hkv, s, d, generator=g, dtype=dtype)
    do = torch.randn(b, hq, s, d, generator=g, dtype=dtype)
    return q, k, v, do


def _errors(grid, variant, causal, hq, hkv, layout, dtype=torch.float64, d=8, chunk=2,
            use_kernels=False):
    """[out, dQ, dK, dV] relative errors of one variant against full attention in float64."""
    cp, r = grid.cp.size, grid.cp.rank
    q, k, v, do = _tensors(2, hq, hkv, 2 * cp * chunk, d, dtype)
    ref = [t.to(torch.float64, copy=True).requires_grad_() for t in (q, k, v)]
    out_ref = torch_attention(*ref, causal, d ** -0.5)
    out_ref.backward(do.double())
    mine = [shard_sequence(t, cp, r, layout, dim=2).requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*mine, grid, variant=variant, causal=causal, layout=layout,
                                     use_kernels=use_kernels)
    out.backward(shard_sequence(do, cp, r, layout, dim=2))
    full = [unshard_sequence(t.detach(), grid.cp, layout, dim=2) for t in (out, *(m.grad for m in mine))]
    return [rel_err(a, e) for a, e in zip(full, (out_ref, *(t.grad for t in ref)))]


def _all_cases(cp, variant, planted=False):
    a2a = {"cp_a2a": 2} if variant == "hierarchical" else {}      # Ulysses in pairs, ring across
    grid = build_grid(ParallelConfig(cp=cp, cp_variant=variant, **a2a))
    with merged_without_rescale() if planted else contextlib.nullcontext():
        cases = {}
        for causal in (True, False):
            for layout in ("zigzag", "contiguous"):
                for hq, hkv in ((4, 4), (4, 2) if variant != "ulysses" or cp == 2 else (8, 4)):
                    key = f"{'causal' if causal else 'full'}-{layout}-hq{hq}-hkv{hkv}"
                    cases[key] = _errors(grid, variant, causal, hq, hkv, layout)
        return cases


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_equals_full_attention(run_ranks, cp, variant):
    """Outputs, dQ, dK, dV of every rank, gathered in order, equal full attention's: causal and
    not, zigzag and contiguous, multi-head and grouped-query."""
    cases = run_ranks(_all_cases, cp, variant, world_size=cp)[0]
    for name, errs in cases.items():
        for what, err in zip(("out", "dQ", "dK", "dV"), errs):
            assert err < TOL64, f"{variant} cp={cp} {name}: {what} rel err {err:.1e}"


@pytest.mark.parametrize("variant", ["ring", "allgather"])
def test_planted_merge_without_rescale_is_caught(run_ranks, variant):
    """Summing the blocks' outputs as they come (no exp(lse_block - lse) rescale) fails."""
    cases = run_ranks(_all_cases, 2, variant, True, world_size=2)[0]
    assert max(errs[0] for errs in cases.values()) > 0.1


def _kernel_ring(use_kernels):
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"     # ops reads it on every call; triton.jit on import
    try:
        from minitron.kernels import flash_attention
        flash_attention.last_launch.clear()
        errs = _errors(build_grid(ParallelConfig(cp=2)), "ring", True, 2, 1, "zigzag",
                       dtype=torch.float32, d=16, chunk=4, use_kernels=use_kernels)
        return errs, sorted(flash_attention.last_launch)
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before


def test_ring_blocks_on_the_flash_kernel(run_ranks):
    """use_kernels: each block runs on minitron's flash-attention kernel (Triton's interpreter
    on the CPU) and merges through its log-sum-exp; float32 against float64."""
    pytest.importorskip("triton")
    if torch.cuda.device_count() > 0 and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("this process imported triton compiled for its GPU; the pool's CPU ranks "
                    "need the interpreter (tests/test_model_kernels.py runs such checks)")
    errs, launched = run_ranks(_kernel_ring, True, world_size=2)[0]
    assert launched == ["dkdv", "dq", "fwd"], launched
    assert max(errs) < 1e-5, errs


# ---- the split and its balance -------------------------------------------------------------
def test_chunks_and_positions():
    assert [chunk_ids(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert [chunk_ids(4, r, "contiguous") for r in range(4)] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    for layout in ("zigzag", "contiguous"):
        every = torch.cat([positions(24, 3, r, layout) for r in range(3)])
        assert sorted(every.tolist()) == list(range(24))
    with pytest.raises(ValueError, match="2\\*cp"):
        positions(10, 4, 0)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_zigzag_balances_causal_work(cp):
    """Every rank computes the same number of scores under zigzag; contiguous is off by about
    2cp-1 (reported); both add up to the causal triangle s(s+1)/2."""
    s = 64 * cp
    for layout in ("zigzag", "contiguous"):
        assert sum(scores_per_rank(s, cp, layout)) == s * (s + 1) // 2
    zig = scores_per_rank(s, cp)
    assert len(set(zig)) == 1 and imbalance(s, cp) == 1.0
    ratio = imbalance(s, cp, "contiguous")
    print(f"cp={cp}: contiguous split, busiest/least busy rank = {ratio:.2f} (zigzag 1.00)")
    c = s // (2 * cp)   # first rank: c(c+1)/2 + c^2 + c(c+1)/2; last: (4cp-3) c^2 + c(c+1)
    assert ratio == ((4 * cp - 3) * c * c + c * (c + 1)) / (c * c + c * (c + 1))
    flops = attention_flops_per_rank(s, cp, batch=2, heads=4, head_dim=16)
    assert flops == [4 * 2 * 4 * 16 * n for n in zig]
    assert scores_per_rank(s, cp, causal=False) == [s * s // cp] * cp


# ---- measured memory and traffic -----------------------------------------------------------
B, H, S, D = 1, 4, 32, 16


def _measure(cp, variant):
    """Saved bytes, peak live bytes and comm bytes (forward / backward) of one attention call."""
    grid = build_grid(ParallelConfig(cp=cp))
    q, k, v, do = (t[:, :, : S // cp].contiguous() for t in _tensors(B, H, H, S, D, torch.float32))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with PeakBytes() as peak:
        with comm.counting() as fwd, saved_bytes() as saved:
            out = context_parallel_attention(q, k, v, grid, variant=variant)
        with comm.counting() as bwd:
            out.backward(do)
    return {"saved": saved.bytes, "peak": peak.peak, "fwd_sent": fwd.wire_bytes("send"),
            "bwd_sent": bwd.wire_bytes("send"), "fwd_wire": fwd.wire_bytes(), "bwd_wire": bwd.wire_bytes(),
            "fwd_messages": fwd.calls("send")}


def test_saved_activations_fall_as_one_over_cp(run_ranks):
    """What the ring keeps for backward (q, k, v, out, lse of its s/cp tokens; never the
    s x s probabilities) halves with every doubling of cp."""
    saved = {cp: run_ranks(_measure, cp, "ring", world_size=cp)[0]["saved"] for cp in (1, 2, 4)}
    per_token = (4 * B * H * D + B * H) * 4      # q, k, v, out + lse, float32
    assert saved == {cp: per_token * S // cp for cp in (1, 2, 4)}, saved


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_bytes_equal_the_formula(run_ranks, cp):
    """Forward: cp-1 K/V blocks sent per rank; backward: cp-1 blocks and cp-1 dK/dV hops."""
    got = run_ranks(_measure, cp, "ring", world_size=cp)
    formula = ring_bytes(B, H, S, D, cp)
    for rank, m in enumerate(got):
        assert (m["fwd_sent"], m["bwd_sent"]) == (formula["forward"], formula["backward"]), rank
        assert m["fwd_messages"] == cp - 1


def test_three_variants_side_by_side(run_ranks):
    """Traffic and peak memory of ring, all-gather and Ulysses at cp=4, measured; each
    variant's wire bytes equal its formula."""
    cp, rows = 4, {}
    for variant in ("allgather", "ring", "ulysses"):      # hierarchical: test_cp_hierarchical.py
        rows[variant] = run_ranks(_measure, cp, variant, world_size=cp)[0]
    kv = 2 * B * H * S * D * 4          # the whole sequence's K and V, float32 bytes
    part = (cp - 1) / cp
    assert rows["ring"]["fwd_wire"] == ring_bytes(B, H, S, D, cp)["forward"]
    assert rows["allgather"]["fwd_wire"] == part * kv
    assert rows["allgather"]["bwd_wire"] == 2 * part * kv          # all-gather + reduce-scatter
    qkvo = 4 * B * H * (S // cp) * D * 4                           # q, k, v in; out back
    assert rows["ulysses"]["fwd_wire"] == part * qkvo
    assert rows["ulysses"]["bwd_wire"] == part * qkvo
    print(f"\ncp={cp}, b={B} h={H} s={S} d={D}, float32, per rank:")
    print(f"{'variant':10} {'fwd wire B':>11} {'bwd wire B':>11} {'saved B':>9} {'peak B':>9}")
    for variant, m in rows.items():
        print(f"{variant:10} {m['fwd_wire']:11.0f} {m['bwd_wire']:11.0f} {m['saved']:9d} {m['peak']:9d}")
    # the all-gather holds every rank's K/V at once; the ring only two blocks
    assert rows["allgather"]["peak"] > rows["ring"]["peak"]


def test_config_validates_the_variant_up_front():
    from minitron.model.splits import validate_model
    from minitron.model import ModelConfig
    with pytest.raises(ValueError, match="cp_variant='star'.*ring"):
        ParallelConfig(cp=2, cp_variant="star")
    gqa = ModelConfig(hidden=32, n_heads=4, n_kv_heads=2, seq_len=16)
    with pytest.raises(ValueError, match="1 key/value heads"):
        validate_model(ParallelConfig(tp=2, cp=2, sequence_parallel=True, cp_variant="ulysses"), gqa)
    validate_model(ParallelConfig(tp=2, cp=2, sequence_parallel=True, cp_variant="ring"), gqa)
    with pytest.raises(ValueError, match=r"seq_len=12 is not divisible by 2 \* cp=4: .*; use cp=3 or cp=6 or seq_len=16"):
        validate_model(ParallelConfig(cp=4), ModelConfig(seq_len=12))
