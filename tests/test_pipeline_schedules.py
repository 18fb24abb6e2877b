"""Pipeline schedules as data: every schedule passes the checker, broken ones are caught with the
rank named, and the simulator reproduces the published bubbles exactly (Fractions, no rounding)."""
from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest

from minitron.pipeline import SCHEDULES, Costs, ScheduleError, check, make_schedule, simulate
from minitron.pipeline.actions import (B, BW, F, RECV_B, RECV_F, SEND_F, W, Action,
                                       Schedule)
from minitron.pipeline.check import batches
from minitron.pipeline.simulate import gaps_per_rank, idle_per_rank

VIRTUAL = {"gpipe": (1,), "1f1b": (1,), "interleaved": (1, 2, 3), "zb-h1": (1,), "zb-h2": (1,),
           "zb-v": (2,), "dualpipev": (2,)}


def grid(name):
    for pp in (1, 2, 3, 4, 5):
        for m in range(1, 11):
            for v in VIRTUAL[name]:
                if name == "interleaved" and m % pp:
                    continue
                yield pp, m, v


def test_registry_is_the_tested_set():
    assert set(SCHEDULES) == set(VIRTUAL)


@pytest.mark.parametrize("name", sorted(VIRTUAL))
def test_every_schedule_passes_the_checker(name):
    for pp, m, v in grid(name):
        report = check(make_schedule(name, pp, m, v))
        assert set(report.peak_activations) == set(range(pp))


def test_make_schedule_validates_with_the_fix_in_the_message():
    with pytest.raises(ValueError, match="choose one of"):
        make_schedule("pipedream", 2, 4)
    with pytest.raises(ValueError, match="multiple of pp"):
        make_schedule("interleaved", 4, 6, 2)
    with pytest.raises(ValueError, match="virtual=2"):
        make_schedule("1f1b", 2, 4, 2)
    with pytest.raises(ValueError, match="virtual=1"):
        make_schedule("zb-v", 2, 4, 1)
    assert make_schedule("zb-v", 2, 4).virtual == 2            # default: each schedule's own
    assert make_schedule("interleaved", 2, 4).virtual == 2


# ---- memory: peak micro-batches alive (F until W/BW), in full-stage units -----------------

def test_peak_activations_match_the_formulas():
    for pp, m, _ in grid("1f1b"):
        assert check(make_schedule("gpipe", pp, m)).peak_activations == {r: m for r in range(pp)}
        assert check(make_schedule("1f1b", pp, m)).peak_activations == {
            r: min(pp - r, m) for r in range(pp)}
        if m >= pp:   # ZB-H1 holds back r W's on rank r: every rank has 1F1B's rank-0 peak p
            assert check(make_schedule("zb-h1", pp, m)).peak_activations == {
                r: pp for r in range(pp)}
    for pp, m, v in grid("interleaved"):    # Megatron: warm-up (p-1-r)*2 + (v-1)p chunks, +1
        peaks = check(make_schedule("interleaved", pp, m, v)).peak_activations
        warm = (pp - 1 - r for r in range(pp)) if v == 1 else (
            (pp - 1 - r) * 2 + (v - 1) * pp for r in range(pp))
        assert peaks == {r: Fraction(min(w + 1, m * v), v) for r, w in enumerate(warm)}


def test_zb_v_keeps_1f1b_peak_memory():
    for pp in (1, 2, 3, 4, 5):
        for m in range(2 * pp - 1, 2 * pp + 4):
            zbv = check(make_schedule("zb-v", pp, m)).peak_activations
            assert max(zbv.values()) == check(make_schedule("1f1b", pp, m)).peak == pp


# ---- the checker rejects broken schedules and says where -------------------------------

def edited(schedule: Schedule, rank: int, actions: list[Action]) -> Schedule:
    return dataclasses.replace(schedule, actions={**schedule.actions, rank: tuple(actions)})


def test_b_before_f_is_rejected():
    s = make_schedule("zb-h1", 2, 2)
    acts = list(s.actions[1])
    i, j = acts.index(Action(F, 0, 1)), acts.index(Action(B, 0, 1))
    acts[i], acts[j] = acts[j], acts[i]
    with pytest.raises(ScheduleError, match=r"rank 1, action \d+ \(B0@s1\).*before its F0@s1"):
        check(edited(s, 1, acts))


def test_unmatched_send_is_rejected():
    s = make_schedule("1f1b", 2, 2)
    acts = [a for a in s.actions[1] if a != Action(RECV_F, 1, 1, 0)]
    with pytest.raises(ScheduleError, match="rank 1"):
        check(edited(s, 1, acts))                 # F1@s1 now lacks its input
    extra = list(s.actions[0]) + [Action(SEND_F, 1, 0, 1)]
    with pytest.raises(ScheduleError, match=r"rank 0, action \d+ \(SEND_F1@s0->1\)"):
        check(edited(s, 0, extra))                # repeated send: repeats an earlier action
    s3 = make_schedule("1f1b", 3, 1)              # a receive whose send was dropped
    dropped = [a for a in s3.actions[1] if a.kind != SEND_F]
    with pytest.raises(ScheduleError, match=r"rank 2, action 0 \(RECV_F0@s2<-1\): no action "
                                            r"on rank 1 sends it"):
        check(edited(s3, 1, dropped))


def test_receiving_first_on_both_ranks_deadlocks():
    # Rank 0 waits for a gradient before sending its activation; rank 1 waits for the activation.
    s = make_schedule("1f1b", 2, 1)
    first = [Action(RECV_B, 0, 0, 1)] + [a for a in s.actions[0] if a.kind != RECV_B]
    with pytest.raises(ScheduleError, match=r"deadlocks.*rank 0 is stuck at actions 0\.\.0.*"
                                            r"rank 1 is stuck"):
        check(edited(s, 0, first))


def test_missing_w_and_wrong_rank_are_rejected():
    s = make_schedule("zb-h1", 2, 2)
    acts = [a for a in s.actions[0] if a != Action(W, 1, 0)]
    with pytest.raises(ScheduleError, match="rank 0, micro-batch 1 of stage 0: lacks its W"):
        check(edited(s, 0, acts))
    acts = list(s.actions[0]) + [Action(F, 0, 1)]
    with pytest.raises(ScheduleError, match=r"rank 0, action \d+ \(F0@s1\): stage 1 lives on "
                                            r"rank 1"):
        check(edited(s, 0, acts))


def test_messages_are_paired_like_megatron():
    """1F1B's steady state posts send_forward_recv_backward and send_backward_recv_forward."""
    s = make_schedule("1f1b", 4, 8)
    for r in (1, 2):
        kinds = [frozenset(a.kind for a in s.actions[r][i:j]) for i, j in batches(s.actions[r])]
        assert {"SEND_F", "RECV_B"} in kinds and {"SEND_B", "RECV_F"} in kinds


# ---- the simulator: the published bubbles, exactly --------------------------------------

def test_gpipe_and_1f1b_bubble():
    for name in ("gpipe", "1f1b"):
        for pp, m, _ in grid(name):
            t = simulate(make_schedule(name, pp, m))     # F = B = W = 1, so BW = 2
            assert t.bubble_fraction == Fraction(pp - 1, m + pp - 1)
            assert t.bubble_ratio == Fraction(pp - 1, m)
            assert t.makespan == 3 * (m + pp - 1)


def test_interleaved_bubble_is_v_times_smaller():
    for pp, m, v in grid("interleaved"):
        t = simulate(make_schedule("interleaved", pp, m, v))
        assert t.bubble_ratio == Fraction(pp - 1, v * m), (pp, m, v)


@pytest.mark.parametrize("costs", [Costs(1, 1, 1), Costs(1, 2, 1), Costs(2, 3, 2)])
def test_zb_h1_idles_f_plus_b_minus_w_per_step(costs):
    """Idle per rank: 1F1B (p-1)(F+B+W); ZB-H1 (p-1)(F+B-W), a third at F = B = W (m >= p).
    Exact whenever W = F (any B). With W != F ZB-H1's fixed order idles in the steady state too
    (e.g. F=2, B=3, W=1, p=2, m=3: 5, not 4): adapting the order to the costs is the job of the
    paper's automatic scheduler, not of the handcrafted ZB-H1."""
    for pp, m, _ in grid("zb-h1"):
        if m < pp:
            continue
        one = idle_per_rank(simulate(make_schedule("1f1b", pp, m), costs))
        zb = idle_per_rank(simulate(make_schedule("zb-h1", pp, m), costs))
        assert set(one.values()) == {(pp - 1) * (costs.F + costs.B + costs.W)}
        assert set(zb.values()) == {(pp - 1) * (costs.F + costs.B - costs.W)}, (pp, m)


def test_zb_v_zero_bubble():
    """ZB-V at F = B = W and m >= 2p-1 (the handcrafted pattern's condition, tight: at
    m = 2p-2 a gap opens): no rank idles between its own first and last action. The only idle
    left is the start-up skew, (p-1) chunk forwards = (p-1)F/2 per rank, which overlaps the
    previous iteration's tail once the optimizer step does not synchronise (the paper's
    post-validation); 1F1B idles (p-1)(F+B+W) = 6x that."""
    for pp in (1, 2, 3, 4, 5):
        for m in range(2 * pp - 1, 2 * pp + 4):
            t = simulate(make_schedule("zb-v", pp, m))
            assert set(gaps_per_rank(t).values()) == {0}, (pp, m)
            assert set(idle_per_rank(t).values()) == {Fraction(pp - 1, 2)}
        if pp > 1:
            t = simulate(make_schedule("zb-v", pp, 2 * pp - 2))
            assert max(gaps_per_rank(t).values()) > 0


def test_zb_h2_is_a_parallelogram_at_2p_minus_1_memory():
    """ZB-H2 at F = B = W, m >= 2p-1: no gap inside any rank's span, idle only the skew
    (p-1)F, for the paper's memory of 2p-1 micro-batches alive on every rank."""
    for pp in (1, 2, 3, 4, 5):
        for m in range(2 * pp - 1, 2 * pp + 4):
            s = make_schedule("zb-h2", pp, m)
            t = simulate(s)
            assert set(gaps_per_rank(t).values()) == {0}, (pp, m)
            assert set(idle_per_rank(t).values()) == {pp - 1}
            assert set(check(s).peak_activations.values()) == {2 * pp - 1}


def test_latency_adds_two_hops_per_stage_boundary_to_gpipe():
    """GPipe: the first micro-batch crosses p-1 boundaries forward and p-1 back, so the
    makespan is (m+p-1)(F+B+W) + 2(p-1)*latency."""
    for pp, m, _ in grid("gpipe"):
        t = simulate(make_schedule("gpipe", pp, m), Costs(latency=Fraction(1, 4)))
        assert t.makespan == 3 * (m + pp - 1) + Fraction(2 * (pp - 1), 4)


def test_simulation_refuses_a_broken_schedule():
    s = make_schedule("gpipe", 2, 1)
    with pytest.raises(ScheduleError):
        simulate(edited(s, 0, [a for a in s.actions[0] if a.kind != BW]))


def test_costs_are_validated():
    with pytest.raises(ValueError, match="Costs.latency must be >= 0"):
        Costs(latency=-1)


# ---- the same order as torch.distributed.pipelining --------------------------------------

def torch_orders():
    pytest.importorskip("torch.distributed.pipelining")
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules as ts
    kinds = {"F": F, "B": BW, "I": B, "W": W}

    def convert(order):
        return [(kinds[a.computation_type.value], a.microbatch_index, a.stage_index)
                for a in order if a is not None and a.computation_type.value in kinds]
    return ts, SimpleNamespace, convert


def compute_order(schedule, rank):
    return [(a.kind, a.microbatch, a.stage) for a in schedule.compute(rank)]


def test_compute_order_matches_torch():
    """torch builds each rank's order as data (pipeline_order); ours agrees for GPipe,
    interleaved 1F1B, ZB-H1 (torch's ScheduleInterleavedZeroBubble with one stage per rank)
    and ZB-V. 1F1B agrees on every rank but the last, where torch's pipeline_order (used for
    its visualiser, not its runtime) numbers the micro-batches from 1: F1 BW0 F2 BW1 ..."""
    ts, NS, convert = torch_orders()
    try:
        for pp, m in ((2, 4), (3, 3), (4, 8), (4, 12)):
            gp = ts.ScheduleGPipe._get_pipeline_order(NS(_num_stages=pp, _n_microbatches=m))
            ob = ts.Schedule1F1B._get_pipeline_order(NS(_num_stages=pp, _n_microbatches=m))
            zbv = NS(pp_group_size=pp, _n_microbatches=m, num_stages=2 * pp)
            for r in range(pp):
                assert convert(gp[r]) == compute_order(make_schedule("gpipe", pp, m), r)
                ours = compute_order(make_schedule("1f1b", pp, m), r)
                if r == pp - 1:
                    ours = [(k, mb + (k == F), s) for k, mb, s in ours]
                assert convert(ob[r]) == ours
                assert convert(ts.ScheduleZBVZeroBubble._calculate_single_rank_operations(
                    zbv, r)) == compute_order(make_schedule("zb-v", pp, m), r)
            for v in (1, 2, 3):     # torch's v=1 interleaved warms up 2(p-1-r): not Megatron's
                ns = NS(n_local_stages=v, pp_group_size=pp, _n_microbatches=m,
                        microbatches_per_round=pp)
                for cls, name in ((ts.ScheduleInterleaved1F1B, "interleaved"),
                                  (ts.ScheduleInterleavedZeroBubble, "zb-h1")):
                    if (name == "zb-h1") != (v == 1):
                        continue
                    for r in range(pp):
                        assert convert(cls._calculate_single_rank_operations(ns, r)) == \
                            compute_order(make_schedule(name, pp, m, v), r), (name, pp, m, v, r)
    except (AttributeError, TypeError) as e:    # private API moved in another torch version
        pytest.skip(f"torch's schedule internals differ in this version: {e}")


def lazy_messages(schedule: Schedule) -> Schedule:
    """The naive rule: each receive just before its use, each send just after its producer."""
    sr, last, out = schedule.stage_rank, schedule.n_stages - 1, {}
    for r in range(schedule.pp):
        acts = []
        for a in schedule.compute(r):
            s, mb = a.stage, a.microbatch
            if a.kind == F and s > 0 and sr[s - 1] != r:
                acts.append(Action(RECV_F, mb, s, sr[s - 1]))
            if a.kind in (B, BW) and s < last and sr[s + 1] != r:
                acts.append(Action(RECV_B, mb, s, sr[s + 1]))
            acts.append(a)
            if a.kind == F and s < last and sr[s + 1] != r:
                acts.append(Action(SEND_F, mb, s, sr[s + 1]))
            if a.kind in (B, BW) and s > 0 and sr[s - 1] != r:
                acts.append(Action("SEND_B", mb, s, sr[s - 1]))
        out[r] = tuple(acts)
    return dataclasses.replace(schedule, actions=out)


def test_receiving_just_in_time_deadlocks_interleaved():
    """Why with_messages orders messages globally: with receives placed just before use,
    1F1B still runs, but interleaved 1F1B deadlocks (both ranks send a gradient and wait,
    neither has posted the receive), as Megatron's prefetching receives avoid."""
    check(lazy_messages(make_schedule("1f1b", 4, 8)))
    with pytest.raises(ScheduleError, match="deadlocks.*rank 0 is stuck.*rank 1 is stuck"):
        check(lazy_messages(make_schedule("interleaved", 2, 4, 2)))


def test_messages_listed_in_another_order_than_sent_are_rejected():
    """Backends pair a rank's messages to another by posting order: swapped receives would
    silently swap two micro-batches' activations (same shapes), so the checker refuses them."""
    s = make_schedule("gpipe", 2, 2)
    rest = [a for a in s.actions[1] if a.kind != RECV_F]
    swapped = [Action(RECV_F, 1, 1, 0), Action(RECV_F, 0, 1, 0)] + rest
    with pytest.raises(ScheduleError, match=r"rank 1, action 0 \(RECV_F1@s1<-0\): is rank 1's "
                                            r"receive number 0 from rank 0, whose send number 0 "
                                            r"is SEND_F0@s0->1"):
        check(edited(s, 1, swapped))
    check(edited(s, 1, [Action(RECV_F, 0, 1, 0), Action(RECV_F, 1, 1, 0)] + rest))  # in order
