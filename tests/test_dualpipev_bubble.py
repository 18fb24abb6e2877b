"""Why DualPipeV's simulated bubble leaves DeepSeek-V3's Table 2 formula when the chunk times
differ: the makespan is the longest chain of dependent actions (simulate.critical_path), and the
formula counts one chain's mix of F, B and W. At F = B = W every chain ties; with the input
gradient B slower than F, the fixed order (torch's ScheduleDualPipeV, written for equal times)
has a chain with floor((p-1)/2) more B's in place of F's, so the idle per rank is the formula's
plus floor((p-1)/2)(B - F) (per-chunk times), exactly."""
from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest

from minitron.pipeline import Costs, make_schedule, simulate
from minitron.pipeline.actions import BW, F, Timeline
from minitron.pipeline.simulate import critical_path, idle_per_rank


def _table_2(pp: int, costs: Costs) -> Fraction:
    """(PP/2 - 1)(F&B + B - 3W), PP = 2p, per-chunk times, B a full backward, F&B = F + B."""
    f, full, w = Fraction(costs.F, 2), Fraction(costs.B + costs.W, 2), Fraction(costs.W, 2)
    return (pp - 1) * ((f + full) + full - 3 * w)


@pytest.mark.parametrize("costs", [Costs(1, 1, 1), Costs(1, 2, 1), Costs(2, 1, 1), Costs(1, 3, 2)])
def test_the_critical_path_is_a_gapless_chain_as_long_as_the_makespan(costs):
    for pp, m in ((2, 4), (3, 8), (5, 12)):
        s = make_schedule("dualpipev", pp, m)
        t = simulate(s, costs)
        path = critical_path(s, t)
        assert sum(e.end - e.start for e in path) == t.makespan
        assert path[0].start == 0 and path[-1].end == t.makespan
        assert all(a.end == b.start for a, b in zip(path, path[1:]))


def test_with_b_slower_than_f_the_excess_is_floor_half_p_minus_1_times_b_minus_f():
    for F_, B_, W_ in ((1, 1, 1), (1, 2, 1), (1, 3, 2), (2, 3, 3), (1, 5, 4)):
        costs = Costs(F_, B_, W_)
        for pp in range(2, 7):
            for m in (2 * pp, 2 * pp + 3):
                idle = idle_per_rank(simulate(make_schedule("dualpipev", pp, m), costs))
                excess = (pp - 1) // 2 * Fraction(B_ - F_, 2)
                assert set(idle.values()) == {_table_2(pp, costs) + excess}, (costs, pp, m)


def test_the_longer_chain_has_more_b_and_fewer_f():
    """pp 3, m 8: the formula's chain has 2m+p-1 F, 2m+2(p-1) B, 2m-(p-1) W (busy + bubble);
    the critical one one F fewer and one B more (a BW counts as a B and a W)."""
    s = make_schedule("dualpipev", 3, 8)
    path = critical_path(s, simulate(s, Costs(1, 2, 1)))
    count = lambda *kinds: sum(e.kind in kinds for e in path)
    assert (count(F), count("B", BW), count("W", BW)) == (16 + 2 - 1, 16 + 4 + 1, 16 - 2)


def test_a_gap_on_the_chain_is_refused():
    """Planted: a simulated timeline with one event delayed (idle appears before it): no event
    ends when it starts, so the walk back stops with an error instead of a wrong chain."""
    s = make_schedule("dualpipev", 2, 4)
    t = simulate(s, Costs(1, 1, 1))
    last = max(t.events, key=lambda e: e.end)
    moved = [dataclasses.replace(e, start=e.start + 1, end=e.end + 1) if e is last else e
             for e in t.events]
    with pytest.raises(RuntimeError, match="nothing ends when"):
        critical_path(s, Timeline(t.name, t.pp, moved))
