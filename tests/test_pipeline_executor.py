"""The pipeline executor against the single-device reference, and what it measures.

Numbers: every schedule (GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-H2, ZB-V), plain and with TP=2 + SP,
through minitron.verify's per-rank body (logits of every micro-batch, loss, dL/dX, every
gradient and every updated weight, at the verifier's float32 tolerances; the tied embedding's
two copies bitwise equal): the tests and `python -m minitron.verify --pp ...` check the same
thing. Planted executor bugs (a gradient delivered to the wrong stage, a W dropped, the tied
embedding's gradients not summed) fail by name. Traffic: exactly two activation-sized messages
per micro-batch per stage boundary between ranks (1/tp of it under SP). Timeline: every compute
action once per rank, in the schedule's order, causally ordered on one clock. Memory: the
measured (micro-batch, stage) pairs alive at the peak equal the checker's prediction.
"""
import dataclasses
from fractions import Fraction

import pytest
import torch

from minitron.runtime import comm
from minitron.grid import ParallelConfig, build_grid
from minitron.model import GPT, ModelConfig
from minitron.model.convert import gather_state_dict, shard_state_dict
from minitron.pipeline import executor, measure
from minitron.pipeline.actions import BW, F
from minitron.pipeline.check import check
from minitron.pipeline.p2p import check_message_order
from minitron.model.stages import PipelineGPT, check_placement
from minitron.pipeline.schedules import make_schedule
from minitron.tensor_parallel import weight_grad
from minitron.verify import Report, make_batch, run_rank
from minitron.verify.checks import pattern

BASE = dict(vocab_size=64, seq_len=8, hidden=32, n_layers=4, n_heads=4, dropout=0.1)
PP, M = 2, 4
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zb-h1": 1, "zb-h2": 1, "zb-v": 2}   # name: virtual
SPLITS = {"plain": (1, False), "tp2-sp": (2, True)}


def _schedule(name, pp=PP, m=M):
    return make_schedule(name, pp, m, SCHEDULES[name])


def _verify(run_ranks, name, split="plain", plant=None, steps=2, **opts):
    tp, sp = SPLITS[split]
    sched = _schedule(name)
    pcfg = ParallelConfig(tp=tp, pp=PP, virtual_pp=sched.virtual, sequence_parallel=sp)
    rows = run_ranks(run_rank, pcfg, ModelConfig(**{**BASE, **opts}), steps, batch=M, plant=plant,
                     schedule=sched, world_size=pcfg.world_size)[0]
    return Report(rows)


# ---- numbers: every schedule, with and without TP+SP, against one device -------------------------
@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_schedule_matches_reference(run_ranks, name, split):
    tied = name in ("1f1b", "zb-v")          # tied embeddings: across ranks (1F1B), on one (ZB-V)
    report = _verify(run_ranks, name, split, tie_embeddings=tied)
    assert report.passed, report.table()
    names = {pattern(n) for n in GPT(ModelConfig(**{**BASE, "tie_embeddings": tied})).state_dict()}
    for kind in ("grad", "weight"):
        assert {r.quantity.split(" ", 1)[1] for r in report.rows if r.quantity.startswith(kind)} == names
    assert {r.quantity for r in report.rows} >= {"logits", "loss", "dL/dX", "replicas grads"}


def test_pp4_interleaved_with_middle_stages_matches_reference(run_ranks):
    """The issue's `--pp 4 --virtual 2 --schedule interleaved --microbatches 8 --layers 8` (one
    layer per stage), with tied embeddings: ranks 1 and 2 hold no embedding (a group of one)."""
    sched = make_schedule("interleaved", 4, 8, 2)
    cfg = ModelConfig(**{**BASE, "n_layers": 8, "tie_embeddings": True})
    rows = run_ranks(run_rank, ParallelConfig(pp=4, virtual_pp=2), cfg, 1, batch=8, schedule=sched,
                     world_size=4)[0]
    report = Report(rows)
    assert report.passed, report.table()


# ---- tests of the tests: planted executor bugs fail ----------------------------------------------
@pytest.mark.parametrize("name,plant,caught", [
    ("zb-v", "pp-wrong-stage", "dL/dX"),                    # stage 1 gets stage 2's output gradient
    ("zb-h1", "pp-drop-w", "grad layers.*.mlp.fc1.weight"),  # stage 0 misses one micro-batch's dW
])
def test_planted_executor_bug_fails(run_ranks, name, plant, caught):
    report = _verify(run_ranks, name, plant=plant, steps=1)
    by_name = {r.quantity: r for r in report.rows}
    assert not by_name[caught].ok and by_name[caught].err > 100 * by_name[caught].tol, report.table()
    assert by_name["loss"].ok and by_name["logits"].ok       # the forward pass is untouched


def _untied_worker(*args, **kwargs):
    """run_rank with the tied embedding's gradient sum over the embedding group forgotten."""
    saved = PipelineGPT.finalize_grads
    PipelineGPT.finalize_grads = lambda self: super(PipelineGPT, self).finalize_grads()
    try:
        return run_rank(*args, **kwargs)
    finally:
        PipelineGPT.finalize_grads = saved


def test_forgotten_tied_embedding_sum_fails(run_ranks):
    pcfg = ParallelConfig(pp=PP)
    rows = run_ranks(_untied_worker, pcfg, ModelConfig(**BASE, tie_embeddings=True), 1, batch=M,
                     schedule=_schedule("1f1b"), world_size=PP)[0]
    failed = {r.quantity for r in Report(rows).failures}
    assert {"replicas grads", "grad embedding.word.weight"} <= failed, failed


# ---- stages: shard and gather across tp and pp -----------------------------------------------------
def _shard_gather_worker(name, tp, tie):
    sched = _schedule(name)
    grid = build_grid(ParallelConfig(tp=tp, pp=PP, virtual_pp=sched.virtual))
    cfg = ModelConfig(**BASE, tie_embeddings=tie)
    full = GPT(cfg, seed=3).state_dict()
    model = PipelineGPT(cfg, grid, sched.stage_rank, seed=3)   # initialised like GPT(cfg, seed=3)
    local = model.state_dict()
    mine = shard_state_dict(full, cfg, grid, sched.stage_rank)
    back = gather_state_dict(local, cfg, grid, sched.stage_rank)
    layers = sorted({int(k.split(".")[1]) for k in local if k.startswith("layers.")})
    return (mine.keys() == local.keys() and all(torch.equal(mine[k], local[k]) for k in local),
            back.keys() == full.keys() and all(torch.equal(back[k], full[k]) for k in full),
            model.stages, layers, "embedding.word.weight" in local)


@pytest.mark.parametrize("name,tp,tie", [("1f1b", 2, True), ("zb-v", 1, True), ("interleaved", 1, False)])
def test_stages_hold_their_layers_and_gather_to_the_whole_model(run_ranks, name, tp, tie):
    results = run_ranks(_shard_gather_worker, name, tp, tie, world_size=tp * PP)
    sched = _schedule(name)
    per_stage = BASE["n_layers"] // sched.n_stages
    for rank, (fits, whole, stages, layers, word) in enumerate(results):
        assert fits, "PipelineGPT's state dict is not shard_state_dict of the reference's"
        assert whole, "gather_state_dict across stages is not the reference's state dict"
        pp_rank = rank // tp
        assert stages == sched.stages_of(pp_rank)
        assert layers == [i for s in stages for i in range(s * per_stage, (s + 1) * per_stage)]
        assert word == (0 in stages or (tie and sched.n_stages - 1 in stages))


def test_bad_placements_are_value_errors():
    cfg = ModelConfig(**BASE)
    with pytest.raises(ValueError, match="n_layers=4 is not divisible by pp\\*virtual=8"):
        check_placement(cfg, 4, tuple(range(4)) * 2)
    with pytest.raises(ValueError, match="gives the pipeline ranks \\[3, 1\\] stages"):
        check_placement(cfg, 2, (0, 0, 0, 1))
    with pytest.raises(ValueError, match="outside 0..1"):
        check_placement(cfg, 2, (0, 2))
    with pytest.raises(ValueError, match="tied embeddings"):
        check_placement(ModelConfig(**BASE, tie_embeddings=True), 2, (1, 0))


# ---- messages: bytes counted exactly ---------------------------------------------------------------
def _traffic_worker(name, tp, sp):
    sched = _schedule(name)
    cfg = ModelConfig(**BASE)
    grid = build_grid(ParallelConfig(tp=tp, pp=PP, virtual_pp=sched.virtual, sequence_parallel=sp))
    model = PipelineGPT(cfg, grid, sched.stage_rank)
    tokens, targets = make_batch(0, 0, M, cfg.seq_len, cfg.vocab_size)
    model.rng.reset(0)
    with comm.counting() as counts:
        executor.run_schedule(sched, model, tokens, targets, keep_outputs=False)
    return grid.pp.rank, {k: (v["calls"], v["bytes"]) for k, v in counts.as_dict().items()
                          if k.startswith("pp/")}


@pytest.mark.parametrize("name,split", [("1f1b", "plain"), ("zb-v", "plain"), ("interleaved", "tp2-sp")])
def test_bytes_sent_between_stages_are_the_formula(run_ranks, name, split):
    """Per micro-batch, each stage boundary between two ranks carries one activation forward and
    one gradient backward, each mb * s * h * 4 bytes (mb * s/tp * h * 4 under SP)."""
    tp, sp = SPLITS[split]
    sched = _schedule(name)
    mbs = 1                                  # a batch of M: one sequence per micro-batch
    message = mbs * BASE["seq_len"] // (tp if sp else 1) * BASE["hidden"] * 4
    for pp_rank, got in run_ranks(_traffic_worker, name, tp, sp, world_size=tp * PP):
        r = sched.stage_rank
        sends = sum(r[s] != r[s + 1] and pp_rank in (r[s], r[s + 1]) for s in range(sched.n_stages - 1))
        n = M * sends   # this rank sends one message per micro-batch over each of its boundaries
        assert got == {"pp/send": (n, n * message), "pp/recv": (n, n * message)}, (pp_rank, got)


# ---- timeline and memory, measured ---------------------------------------------------------------
def _measured_worker(name, pp, m):
    sched = _schedule(name, pp, m)
    cfg = ModelConfig(**{**BASE, "n_layers": 2 * pp})
    grid = build_grid(ParallelConfig(pp=pp, virtual_pp=sched.virtual))
    model = PipelineGPT(cfg, grid, sched.stage_rank)
    tokens, targets = make_batch(0, 0, m, cfg.seq_len, cfg.vocab_size)
    model.rng.reset(0)
    result = executor.run_schedule(sched, model, tokens, targets, keep_outputs=False, track_memory=True,
                                   start_line=True)
    timeline = measure.gather_timeline(sched, result.events, grid)
    return timeline, result.peak_alive, result.peak_bytes, result.unit_bytes


@pytest.mark.parametrize("name,pp,m", [("gpipe", 2, 4), ("1f1b", 2, 4), ("zb-h1", 2, 4),
                                       ("interleaved", 2, 4), ("zb-v", 2, 4), ("zb-h2", 2, 4), ("1f1b", 4, 8),
                                       ("zb-v", 4, 8)])
def test_measured_timeline_and_peak_memory(run_ranks, name, pp, m):
    sched = _schedule(name, pp, m)
    predicted = check(sched).peak_activations
    results = run_ranks(_measured_worker, name, pp, m, world_size=pp)
    timeline = results[0][0]
    end = {}
    for rank in range(pp):
        mine = sorted((e for e in timeline.events if e.rank == rank), key=lambda e: e.start)
        assert [(e.kind, e.microbatch, e.stage) for e in mine] == \
            [(a.kind, a.microbatch, a.stage) for a in sched.compute(rank)]
        end.update({(e.kind, e.microbatch, e.stage): e.end for e in mine})
    for e in timeline.events:   # one clock: nothing starts before what it consumes was made
        assert e.start <= e.end
        if e.kind == F and e.stage > 0:
            assert e.start >= end[F, e.microbatch, e.stage - 1]
    for rank, (_, alive, peak_bytes, units) in enumerate(results):
        # in stage units: a rank holding v chunks holds 1/v of a stage per (micro-batch, chunk)
        assert Fraction(alive, sched.virtual) == predicted[rank], (rank, alive, predicted)
        assert 0 < peak_bytes <= alive * max(units.values())
        if all(a.kind in (F, BW) for a in sched.compute(rank)) and len(set(units.values())) == 1:
            assert peak_bytes == alive * max(units.values())   # whole graphs alive, nothing else
    if name == "gpipe":
        assert predicted[0] == m                            # grows with the micro-batches
    if name in ("1f1b", "zb-v"):
        assert predicted[0] == pp                           # 1F1B's p in flight; ZB-V the same


def test_measure_returns_every_ranks_timeline_and_memory():
    sched = _schedule("1f1b")
    timeline = measure.measure(sched, ModelConfig(**BASE), steps=1)
    assert timeline.pp == PP and timeline.name == "1f1b"
    assert sorted((e.rank, e.kind, e.microbatch, e.stage) for e in timeline.events) == \
        sorted((r, a.kind, a.microbatch, a.stage) for r in range(PP) for a in sched.compute(r))
    assert 0 <= timeline.bubble_fraction < 1
    peaks = measure.measure_memory(sched, ModelConfig(**BASE))
    assert {r: alive for r, (alive, _) in peaks.items()} == check(sched).peak_activations
    assert all(nbytes > 0 for _, nbytes in peaks.values())


# ---- the B/W split itself ---------------------------------------------------------------------------
def _linear_grads(defer: bool, run_w: bool):
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6, 4, generator=gen))
    b = torch.nn.Parameter(torch.randn(6, generator=gen))
    x = torch.randn(2, 3, 4, generator=gen, requires_grad=True)
    with weight_grad.capture():
        y = weight_grad.linear(x, w, b)
    if defer:
        with weight_grad.deferring("key"):
            y.square().sum().backward()
        assert w.grad is None and b.grad is None and x.grad is not None   # B: only dL/dX
        if run_w:
            assert weight_grad.STORE.pop("key") == 1
    else:
        y.square().sum().backward()
    weight_grad.STORE.clear()
    return x.grad, w.grad, b.grad


def test_deferred_weight_gradient_equals_the_full_backward():
    x0, w0, b0 = _linear_grads(defer=False, run_w=False)
    x1, w1, b1 = _linear_grads(defer=True, run_w=True)
    assert torch.equal(x0, x1) and torch.equal(w0, w1) and torch.equal(b0, b1)
    # the test of the test: a W never run leaves no weight gradient
    _, w2, b2 = _linear_grads(defer=True, run_w=False)
    assert w2 is None and b2 is None


def test_linear_is_f_linear_when_not_capturing():
    x, w = torch.randn(2, 4, requires_grad=True), torch.randn(3, 4)
    assert weight_grad.linear(x, w).grad_fn.name() == torch.nn.functional.linear(x, w).grad_fn.name()
    with weight_grad.capture():
        assert "DeferrableLinear" in weight_grad.linear(x, w).grad_fn.name()


def test_executor_refuses_a_batch_that_does_not_split():
    with pytest.raises(ValueError, match="cannot be cut into 4 equal micro-batches"):
        executor.check_schedule_fits(_schedule("1f1b"), _FakeModel(), 6)


def test_messages_listed_in_another_order_are_refused():
    """Backends match a pair's messages in posting order: swapped receives would swap tensors."""
    sched = _schedule("gpipe", m=2)
    recvs = [i for i, a in enumerate(sched.actions[1]) if a.kind == "RECV_F"]
    acts = list(sched.actions[1])
    acts[recvs[0]], acts[recvs[1]] = acts[recvs[1]], acts[recvs[0]]
    swapped = dataclasses.replace(sched, actions={**sched.actions, 1: tuple(acts)})
    check_message_order(sched)
    with pytest.raises(ValueError, match="rank 1 receives rank 0's messages in the order"):
        check_message_order(swapped)


class _FakeModel:
    placement = (0, 1)
    grid = type("G", (), {"pp": type("P", (), {"size": 2})()})()

