"""Hierarchical context parallelism: Ulysses inside cp_a2a ranks, a ring across the groups.

At cp = 4 = 2 x 2 (tp = 1): the grid's two sub-groups; attention's out, dQ, dK, dV against
full attention on one device (float64, causal and not, zigzag and contiguous, GQA: in
test_context_parallel.py, which runs every variant) and here with the ring planted away
(each group attending to its own tokens only: caught); the wire bytes counted on cp_a2a and
on cp_ring equal context_parallel.hierarchical_bytes exactly, beside the other three variants'
totals; and verify's rows through the whole model (dropout on) PASS.
"""
import torch

from minitron.context_parallel import (context_parallel_attention, hierarchical_bytes, ring_bytes,
                                       shard_sequence, unshard_sequence)
from minitron.context_parallel.ulysses import torch_attention
from minitron.grid import ParallelConfig, build_grid
from minitron.model import ModelConfig
from minitron.runtime import comm
from minitron.grid.subgroups import SUBGROUP_DIMS
from minitron.verify.checks import Report
from minitron.verify.compare import rel_err
from minitron.verify.steps import run_rank
from test_context_parallel import _tensors

HIER = ParallelConfig(cp=4, cp_variant="hierarchical", cp_a2a=2)
B, HQ, HKV, S, D = 1, 4, 2, 32, 8


def test_the_grid_gives_the_two_sub_groups():
    assert HIER.group_ranks(SUBGROUP_DIMS["cp_a2a"]) == [[0, 1], [2, 3]]      # neighbours
    assert HIER.group_ranks(SUBGROUP_DIMS["cp_ring"]) == [[0, 2], [1, 3]]     # same heads
    tp2 = ParallelConfig(tp=2, cp=4, cp_variant="hierarchical", cp_a2a=2)
    assert tp2.group_ranks(SUBGROUP_DIMS["cp_a2a"])[:2] == [[0, 2], [1, 3]]
    assert tp2.group_ranks(SUBGROUP_DIMS["cp_ring"])[:2] == [[0, 4], [1, 5]]


def hierarchical_rank(skip_ring=False, dtype=torch.float32):
    """Errors of out, dQ, dK, dV against full attention, and the wire bytes per sub-group."""
    grid = build_grid(HIER)
    r = grid.cp.rank
    q, k, v, do = (t.to(dtype) for t in _tensors(B, HQ, HKV, S, D, torch.float32))
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    out_ref = torch_attention(*ref, True, D ** -0.5)
    out_ref.backward(do.double())
    mine = [shard_sequence(t, 4, r, dim=2).requires_grad_() for t in (q, k, v)]
    groups = (grid.cp_a2a, comm.single_group("cp_ring")) if skip_ring else grid
    with comm.counting() as fwd:
        out = context_parallel_attention(*mine, groups, variant="hierarchical")
    with comm.counting() as bwd:
        out.backward(shard_sequence(do, 4, r, dim=2))
    full = [unshard_sequence(t.detach(), grid.cp, dim=2) for t in (out, *(m.grad for m in mine))]
    errs = [rel_err(a.double(), e) for a, e in zip(full, (out_ref.detach(), *(t.grad for t in ref)))]
    wire = {g: (fwd.wire_bytes(group=g), bwd.wire_bytes(group=g)) for g in ("cp_a2a", "cp_ring")}
    return errs, wire, fwd.wire_bytes() + bwd.wire_bytes() - sum(map(sum, wire.values()))


def test_hierarchical_equals_full_attention_and_its_bytes_the_formula(run_ranks):
    formula = hierarchical_bytes(B, HQ, HKV, S, D, a2a=2, ring=2)
    for errs, wire, other in run_ranks(hierarchical_rank, world_size=4):
        assert max(errs) < 1e-5, errs                               # float32 blocks
        assert wire == {g: (f["forward"], f["backward"]) for g, f in formula.items()}
        assert other == 0
    # the ring carries the flat ring's block, but over R - 1 = 1 hop instead of cp - 1 = 3
    assert formula["cp_ring"]["forward"] == ring_bytes(B, HKV, S, D, 4)["forward"] / 3
    # backward: R - 1 = 1 K/V block and R - 1 = 1 running dK/dV block (Megatron-Core's a2a+p2p)
    assert formula["cp_ring"]["backward"] == 2 * formula["cp_ring"]["forward"]


def test_in_bfloat16_the_gradients_travel_in_bfloat16(run_ranks):
    """dK, dV cross the ring in the activations' dtype, as K and V do: half float32's bytes."""
    formula = hierarchical_bytes(B, HQ, HKV, S, D, a2a=2, ring=2, element_size=2)
    for errs, wire, other in run_ranks(hierarchical_rank, False, torch.bfloat16, world_size=4):
        assert wire == {g: (f["forward"], f["backward"]) for g, f in formula.items()}
        assert max(errs) < 2e-2, errs                               # bf16 blocks, rounded per hop


def test_planted_skipped_ring_is_caught(run_ranks):
    errs, _, _ = run_ranks(hierarchical_rank, True, world_size=4)[0]
    assert errs[0] > 0.01                # each group saw only its own tokens' keys


def test_hierarchical_verifies_through_the_model(run_ranks):
    mcfg = ModelConfig(vocab_size=64, seq_len=16, hidden=32, n_layers=2, n_heads=4, dropout=0.1)
    rows = run_ranks(run_rank, HIER, mcfg, 1, torch.float32, 0, 1e-4, 1e-6, 2, None, None, None,
                     None, world_size=4)[0]
    report = Report(rows)
    assert report.passed, report.table()
