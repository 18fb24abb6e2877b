"""DualPipeV's overlapped pairs really overlap (pipeline/pairs.py), and change no number.

With experts on 2 ep ranks inside the stages (pp 2 x ep 2, 4 ranks), the executor runs each
(F, BW) pair as two halves taking turns at their all-to-alls. Checked here: the run equals
the same schedule run without overlap bit for bit (loss, logits, dL/dX, every gradient); the
halves really alternate inside each pair (the recorded segments: an F's all-to-all is started,
then the BW computes); the verifier passes it against one device; and a planted overlap bug
(a half that goes on before its all-to-all's bytes have arrived) breaks both checks."""
from __future__ import annotations

import pytest
import torch

from minitron.grid import ParallelConfig, build_grid
from minitron.model import ModelConfig
from minitron.model.stages import PipelineGPT
from minitron.pipeline import make_schedule, pairs
from minitron.pipeline.executor import hides_all_to_all, run_schedule
from minitron.train.step import replica_rows
from minitron.verify import Report, make_batch, run_rank
from minitron.verify.patching import patched

CFG = ModelConfig(vocab_size=64, seq_len=8, hidden=32, n_layers=4, n_heads=4, dropout=0.1,
                  n_experts=4, topk=2)
PCFG = ParallelConfig(pp=2, ep=2, virtual_pp=2)
MICROBATCHES = 4


def _goes_on_early(real):
    """The plant: a half that reads its tokens' receive buffer before the bytes arrived (as if
    none had: zeros), the bug of waiting on the wrong handle or not at all. (The counts'
    all-to-all is left right: zero counts would stop the next collective with a size error.)"""
    def planted(half, op, group, work, out):
        real(half, op, group, work, out)
        if out.is_floating_point():
            out.zero_()
    return planted


def _step(overlap: bool, plant: bool = False):
    """One step of DualPipeV, overlapped or not; every output and gradient, and the segments."""
    sched = make_schedule("dualpipev", 2, MICROBATCHES)
    grid = build_grid(PCFG)
    model = PipelineGPT(CFG, grid, sched.stage_rank, seed=0).train()
    tokens, targets = make_batch(0, 0, 2 * MICROBATCHES, CFG.seq_len, CFG.vocab_size)
    mine = replica_rows(2 * MICROBATCHES, grid, MICROBATCHES)     # its rows of the batch
    tokens, targets = tokens[mine], targets[mine]
    model.rng.reset(0)
    hook = _goes_on_early(pairs._Half.in_flight) if plant else pairs._Half.in_flight
    with pairs.recording() as segments, patched(pairs._Half, "in_flight", hook):
        result = run_schedule(sched, model, tokens, targets, overlap=overlap,
                              rows=mine)
    out = {"grad " + n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    if result.loss is not None:
        out["loss"] = result.loss
    for i, t in enumerate(result.logits or []):
        out[f"logits {i}"] = t
    for i, t in enumerate(result.input_grads or []):
        out[f"dL/dX {i}"] = t
    return out, segments, (hides_all_to_all(model), model.grid.pp.rank)


def _both(plant: bool):
    """(names that differ between the overlapped and the sequential step, segments,
    (whether the model has all-to-alls to hide, the pipeline rank))."""
    apart, _, _ = _step(overlap=False)
    together, segments, hides = _step(overlap=True, plant=plant)
    assert apart.keys() == together.keys()
    differ = [k for k in apart if not torch.equal(apart[k], together[k])]
    return differ, segments, hides


def test_overlapped_pairs_equal_the_sequential_run_bit_for_bit(run_ranks):
    sched = make_schedule("dualpipev", 2, MICROBATCHES)
    for rank, (differ, segments, (hides, pp_rank)) in enumerate(run_ranks(_both, False,
                                                                           world_size=4)):
        assert hides and differ == [], (rank, differ)
        assert sched.overlapped[pp_rank]
        for f, bw in sched.overlapped[pp_rank]:
            mine = [(kind, label) for kind, label, _, _ in segments if label in (str(f), str(bw))]
            # the F computes up to its first all-to-all, the BW computes while it is in flight,
            # then the F, having waited for it, goes on
            assert mine[:3] == [("compute", str(f)), ("compute", str(bw)), ("all_to_all", str(f))], mine
            assert {label for kind, label in mine if kind == "all_to_all"} == {str(f), str(bw)}


def test_a_planted_overlap_bug_changes_the_numbers(run_ranks):
    results = run_ranks(_both, True, world_size=4)
    assert all(differ for differ, _, _ in results), [d for d, _, _ in results]


def _verify_rank(plant: bool):
    hook = _goes_on_early(pairs._Half.in_flight) if plant else pairs._Half.in_flight
    with patched(pairs._Half, "in_flight", hook):
        return run_rank(PCFG, CFG, 2, batch=2 * MICROBATCHES,   # each ep rank holds half the rows
                        schedule=make_schedule("dualpipev", 2, MICROBATCHES))


@pytest.mark.parametrize("plant", [False, True])
def test_the_verifier_passes_the_overlap_and_fails_the_plant(run_ranks, plant):
    report = Report(run_ranks(_verify_rank, plant, world_size=4)[0])
    assert report.passed != plant, report.table()
