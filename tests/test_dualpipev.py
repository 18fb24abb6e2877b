"""DualPipeV: the checker accepts it, its order is torch's, the simulator gives DeepSeek-V3's
Table 2 bubble and memory, overlapping its (F, BW) pairs hides the all-to-all by exactly what
the pairs overlap, and a broken DualPipeV is rejected with the rank named. The executor runs it
and matches one device (the verifier's checks: logits, loss, dL/dX, every gradient and updated
weight), a planted executor bug fails, the measured activations alive are the checker's
PP+1 chunks, and torch.distributed.pipelining's ScheduleDualPipeV, on gloo, gives the same
loss, logits and gradients running the same order (tests/test_pipeline_peer.py's peer)."""
from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest

from minitron.grid import ParallelConfig, build_grid
from minitron.model import ModelConfig
from minitron.pipeline import Costs, ScheduleError, check, make_schedule, simulate
from minitron.pipeline.executor import run_schedule
from minitron.model.stages import PipelineGPT
from minitron.verify import Report, make_batch, run_rank
from minitron.pipeline.actions import BW, B, F, RECV_B
from minitron.pipeline.simulate import idle_per_rank

SHAPES = [(pp, m) for pp in (1, 2, 3, 4, 5) for m in range(2 * pp, 2 * pp + 4)]


def test_checker_accepts_every_shape_and_overlaps_f_with_another_backward():
    for pp in (1, 2, 3, 4, 5):
        for m in range(1, 13):                 # fewer than 2p: built for 2p, the rest dropped
            s = make_schedule("dualpipev", pp, m)
            check(s)
            assert s.stage_rank == tuple(range(pp)) + tuple(reversed(range(pp)))
            for r, pairs in s.overlapped.items():
                for f, b in pairs:
                    assert f.kind == F and b.kind == BW and {f.stage, b.stage} == set(s.stages_of(r))
            if m >= 2 * pp:                     # every rank's steady state is pairs
                assert all(len(s.overlapped[r]) >= m - 2 * pp + 1 for r in range(pp))


def test_compute_order_and_pairs_are_torchs():
    """torch's ScheduleDualPipeV builds its order as data; OVERLAP_F_B is our overlapped pair."""
    pytest.importorskip("torch.distributed.pipelining")
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules as ts
    kinds = {"F": F, "B": BW, "I": "B", "W": "W"}
    try:
        for pp, m in SHAPES:
            s = make_schedule("dualpipev", pp, m)
            for r in range(pp):
                order, pairs = [], []
                for a in ts.ScheduleDualPipeV._calculate_single_rank_operations(
                        SimpleNamespace(pp_group_size=pp, _n_microbatches=m), r):
                    subs = [(kinds[x.computation_type.value], x.microbatch_index, x.stage_index)
                            for x in (a.sub_actions or (a,))]
                    order += subs
                    if a.sub_actions:
                        pairs.append(tuple(subs))
                assert order == [(a.kind, a.microbatch, a.stage) for a in s.compute(r)], (pp, m, r)
                assert pairs == [tuple((x.kind, x.microbatch, x.stage) for x in p)
                                 for p in s.overlapped[r]]
    except (AttributeError, TypeError) as e:    # private API moved in another torch version
        pytest.skip(f"torch's DualPipeV internals differ in this version: {e}")


def test_peak_activations_are_the_papers_pp_plus_one_chunks():
    """Table 2: PP+1 chunk activations per device, PP = 2p chunk-stages; a chunk is half a stage,
    so p + 1/2 in the checker's units: half a stage more than ZB-V's p (the pair's F is alive
    before its BW frees the other micro-batch)."""
    for pp, m in SHAPES:
        peaks = check(make_schedule("dualpipev", pp, m)).peak_activations
        assert peaks == {r: Fraction(2 * pp + 1, 2) for r in range(pp)}
        assert max(check(make_schedule("zb-v", pp, m)).peak_activations.values()) == pp


@pytest.mark.parametrize("costs", [Costs(1, 1, 1), Costs(2, 2, 2)])
def test_bubble_is_table_2s(costs):
    """Idle per rank = (PP/2-1)(F&B + B - 3W), PP = 2p, with per-chunk F, B (a full backward),
    W, and F&B = F + B when the pair is not overlapped: at F=B=W the same as ZB-H1's
    (p-1)(F+B-W), twice ZB-V's start-up skew. The fixed order is written for equal costs
    (like ZB-H1's: adapting it to unequal ones is a scheduler's job)."""
    f, b_full, w = (Fraction(x, 2) for x in (costs.F, costs.B + costs.W, costs.W))
    for pp, m in SHAPES:
        idle = idle_per_rank(simulate(make_schedule("dualpipev", pp, m), costs))
        assert set(idle.values()) == {(pp - 1) * ((f + b_full) + b_full - 3 * w)}, (pp, m)


@pytest.mark.parametrize("comm", [Fraction(1, 2), 1, 2])
def test_overlapping_pairs_hides_the_all_to_all(comm):
    """With the MoE all-to-all inside each F and B (Costs.comm), running each pair as one saves
    each rank exactly sum over its pairs of (both apart - max(compute, comm)), and the run ends
    sooner; with no communication there is nothing to hide."""
    for pp, m in ((2, 4), (2, 8), (4, 8), (4, 12)):
        s = make_schedule("dualpipev", pp, m)
        base = Costs(1, 1, 1)
        assert simulate(s, base, overlap=True).events == simulate(s, base).events
        costs = dataclasses.replace(base, comm=comm)
        apart, together = simulate(s, costs), simulate(s, costs, overlap=True)
        per_pair = (Fraction(1 + comm) + Fraction(2 + comm)) / 2 - max(Fraction(3), 2 * comm) / 2
        for r in range(pp):
            assert apart.busy(r) - together.busy(r) == len(s.overlapped[r]) * per_pair
        assert together.makespan < apart.makespan


def _edited(s, rank, actions):
    return dataclasses.replace(s, actions={**s.actions, rank: tuple(actions)})


def test_planted_wrong_dependency_is_rejected():
    """Rank 0's first B of stage 0 moved before the first RECV_B, which brings another
    micro-batch's gradient: its own has not arrived."""
    s = make_schedule("dualpipev", 2, 4)
    acts = list(s.actions[0])
    recv = next(i for i, a in enumerate(acts) if a.kind == RECV_B)
    use = next(i for i, a in enumerate(acts) if a.kind == B and a.stage == 0)
    moved = acts[:recv] + [acts[use]] + [a for i, a in enumerate(acts[recv:], recv) if i != use]
    with pytest.raises(ScheduleError, match=r"rank 0, action \d+ \(B\d@s0\): comes before "
                                            r"RECV_B\d@s0"):
        check(_edited(s, 0, moved))


def test_broken_overlapped_pairs_are_rejected():
    s = make_schedule("dualpipev", 2, 4)
    f, b = s.overlapped[1][0]
    acts = list(s.actions[1])
    i = acts.index(f)
    assert acts[i + 1] == b and acts[i + 2].is_message      # the BW's SEND_B
    acts[i + 1], acts[i + 2] = acts[i + 2], acts[i + 1]      # a message between F and BW
    with pytest.raises(ScheduleError, match=r"rank 1, overlapped pair .*must directly follow"):
        check(_edited(s, 1, acts))
    wrong = dataclasses.replace(s, overlapped={**s.overlapped, 1: ((b, f),)})
    with pytest.raises(ScheduleError, match="must be an F and a backward of another stage"):
        check(wrong)


# ---- the executor, against one device and against torch's DualPipeV --------------------------
BASE = dict(vocab_size=64, seq_len=8, hidden=32, n_layers=4, n_heads=4, dropout=0.1)


def _verify(run_ranks, plant=None, steps=2, **opts):
    sched = make_schedule("dualpipev", 2, 4)
    pcfg = ParallelConfig(pp=2, virtual_pp=2)
    rows = run_ranks(run_rank, pcfg, ModelConfig(**{**BASE, **opts}), steps, batch=4,
                     plant=plant, schedule=sched, world_size=2)[0]
    return Report(rows)


def test_executor_matches_one_device(run_ranks):
    """Dropout on (the masks are keyed by global row, whatever the order) and tied embeddings,
    whose two copies sit on rank 0, the V's two ends."""
    report = _verify(run_ranks, tie_embeddings=True)
    assert report.passed, report.table()
    assert {r.quantity for r in report.rows} >= {"logits", "loss", "dL/dX", "replicas grads"}


def test_a_planted_executor_bug_fails(run_ranks):
    report = _verify(run_ranks, plant="pp-wrong-stage", steps=1)
    by_name = {r.quantity: r for r in report.rows}
    assert not by_name["dL/dX"].ok and by_name["loss"].ok, report.table()


def _measured_peak(pp, m):
    sched = make_schedule("dualpipev", pp, m)
    cfg = ModelConfig(**{**BASE, "n_layers": 2 * pp})
    model = PipelineGPT(cfg, build_grid(ParallelConfig(pp=pp, virtual_pp=2)), sched.stage_rank)
    tokens, targets = make_batch(0, 0, m, cfg.seq_len, cfg.vocab_size)
    model.rng.reset(0)
    result = run_schedule(sched, model, tokens, targets, keep_outputs=False, track_memory=True)
    return result.peak_alive, [(e.kind, e.microbatch, e.stage) for e in result.events]


def test_measured_activations_are_pp_plus_one_chunks(run_ranks):
    sched = make_schedule("dualpipev", 2, 6)
    for rank, (alive, ran) in enumerate(run_ranks(_measured_peak, 2, 6, world_size=2)):
        assert alive == 2 * 2 + 1 == 2 * check(sched).peak_activations[rank]
        assert ran == [(a.kind, a.microbatch, a.stage) for a in sched.compute(rank)]


def test_torch_dualpipev_agrees(run_ranks):
    """torch's ScheduleDualPipeV on the reference's own modules: the same loss, logits and
    gradients as minitron's executor and one device, and torch runs minitron's compute order
    (its OVERLAP_F_B pairs one sub-action after the other, as minitron's CPU executor does)."""
    peer = pytest.importorskip("test_pipeline_peer")
    peer.torch_has("dualpipev")
    cfg = peer.CFG
    results = run_ranks(peer._peer_rank, "dualpipev", 2, 4, cfg, world_size=2)
    theirs, ours, ref = peer._merge(results, "torch"), peer._merge(results, "minitron"), \
        peer._reference(cfg)
    tol = peer.float32_tolerance(cfg, peer.BATCH, cfg.seq_len)
    assert peer.disagreements(theirs, ref, tol) == []
    assert peer.disagreements(ours, theirs, tol) == []
    for rank, r in enumerate(results):
        assert r["torch"][3] == r["minitron"][3] == r["minitron"][4], rank


def test_a_planted_bug_is_caught_by_torchs_dualpipev(run_ranks):
    peer = pytest.importorskip("test_pipeline_peer")
    peer.torch_has("dualpipev")
    cfg = peer.CFG
    results = run_ranks(peer._peer_rank, "dualpipev", 2, 4, cfg, "pp-wrong-stage", world_size=2)
    bad = peer.disagreements(peer._merge(results, "minitron"), peer._merge(results, "torch"),
                             peer.float32_tolerance(cfg, peer.BATCH, cfg.seq_len))
    assert any(k.startswith("grad embedding.") for k in bad), bad


def test_the_command_line_simulates_the_overlap(capsys):
    from minitron.pipeline.__main__ import main
    s, costs = make_schedule("dualpipev", 4, 16), Costs(comm=1)
    for flags, overlap in (([], False), (["--overlap"], True)):
        assert main(["--schedule", "dualpipev", "--pp", "4", "--microbatches", "16",
                     "--comm", "1", *flags]) == 0
        out = capsys.readouterr().out
        assert f"simulated makespan: {simulate(s, costs, overlap=overlap).makespan}" in out, out
        assert ("overlapped pairs" in out) == overlap
    assert main(["--comm", "fast"]) == 2
    assert "--comm 'fast'" in capsys.readouterr().err
