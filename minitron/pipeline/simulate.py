"""Simulate a schedule: when would each action run, given what each costs?

Every rank walks its list in order, as the executor does. A compute action starts when the
rank is free; its inputs are guaranteed by the order (check.py): a local predecessor ran
before it, or a RECV before it completed. A batch of consecutive messages is posted at once:
its sends leave at that moment and never block; the batch completes when its last receive
has arrived, no earlier than its send's time + latency.

Costs are per *stage* (a 1/pp slice of the model): F, B (input gradient), W (weight gradient),
BW = B + W. A rank holding v stages (interleaved, ZB-V) runs chunks 1/v of a stage, so each of
its compute actions costs cost / v: schedules of the same model compare at equal total work.

With F = 1, B = W = 1 (so BW = 2), no latency, p ranks and m micro-batches, one finds
  GPipe, 1F1B     makespan (m+p-1)(F+BW): idle share (p-1)/(m+p-1), idle/busy (p-1)/m
  interleaved     idle/busy (p-1)/(v m)
  ZB-H1           idle per rank (p-1)(F+B-W) instead of (p-1)(F+B+W): 1/3 of 1F1B's at F=B=W
  ZB-H2, ZB-V     each rank busy without a gap from its first action to its last (m >= 2p-1);
                  what is left is the start-up skew: (p-1)F per rank (ZB-H2), (p-1)F/2 (ZB-V)
  DualPipeV       idle per rank (p-1)(F+B+W)/3 at F=B=W: DeepSeek-V3's Table 2 bubble
                  (PP/2-1)(F&B+B-3W) with PP = 2p chunk-stages, B a full backward and the pair
                  F&B = F+B run one after the other (overlap=False); peak p+1/2 (PP+1 chunks).
                  With an input gradient B slower than F (W <= B) it idles floor((p-1)/2)(B-F)
                  more (per-chunk times): the makespan is the longest chain of dependent actions
                  (critical_path), the formula counts one chain's mix of F, B and W, and the
                  fixed order, written for equal times, has a chain with floor((p-1)/2) B's in
                  place of F's (tests/test_dualpipev_bubble.py)
Timeline.bubble_fraction and .bubble_ratio give the first two; Timeline's events draw it.

Communication inside a stage (Costs.comm: the MoE all-to-all, dispatch and combine, in each F
and again in each B or BW; W sends nothing) is time the rank waits unless something hides it.
With overlap=True an overlapped pair of Schedule.overlapped (DualPipeV's F of one micro-batch
with the BW of another) costs max(compute of both, communication of both) instead of their
sum: each one's compute runs while the other's all-to-all is in flight, as DeepSeek's kernels
do on a GPU (communication on its own SMs). The executor does it with two threads taking turns
(pairs.py): one half computes while gloo's threads carry the other's all-to-all (the pipeline's
send/recv are not overlapped).
"""
from __future__ import annotations

import dataclasses
from fractions import Fraction
from numbers import Rational

from .actions import B, BW, F, W, Action, Event, Schedule, Timeline
from .check import _match_key, batches, check


@dataclasses.dataclass(frozen=True)
class Costs:
    """Time of one stage's F, B and W for one micro-batch, and of one message in flight;
    comm: the communication inside one stage's F, and again inside its B (the MoE all-to-all),
    on top of their compute."""
    F: float = 1
    B: float = 1
    W: float = 1
    latency: float = 0
    comm: float = 0

    def __post_init__(self):
        for name in ("F", "B", "W", "latency", "comm"):
            if getattr(self, name) < 0:
                raise ValueError(f"Costs.{name} must be >= 0, got {getattr(self, name)}")
        if self.F + self.B + self.W <= 0:
            raise ValueError("Costs: F + B + W must be positive")

    def parts(self, kind: str, chunks_per_rank: int):
        """(compute, communication) of one action on a rank holding `chunks_per_rank` stages
        (exact for integers)."""
        compute = {F: self.F, B: self.B, W: self.W, BW: self.B + self.W}[kind]
        comm = 0 if kind == W else self.comm
        return tuple(Fraction(x) / chunks_per_rank if isinstance(x, Rational)
                     else x / chunks_per_rank for x in (compute, comm))

    def of(self, kind: str, chunks_per_rank: int):
        """One action's cost on a rank holding `chunks_per_rank` stages: compute + comm."""
        return sum(self.parts(kind, chunks_per_rank))


def _exact(x):
    return Fraction(x) if isinstance(x, Rational) else x


def _overlapped_pair(costs: Costs, f: Action, b: Action, chunks: int):
    """Durations of the two halves of an overlapped pair run as one: max(compute, comm) of the
    two together, split between them in proportion to their costs one after the other."""
    (cf, nf), (cb, nb) = costs.parts(f.kind, chunks), costs.parts(b.kind, chunks)
    together, apart = max(cf + cb, nf + nb), cf + nf + cb + nb
    if apart == 0:
        return 0, 0
    return together * (cf + nf) / apart, together * (cb + nb) / apart


def simulate(schedule: Schedule, costs: Costs = Costs(), *, overlap: bool = False) -> Timeline:
    """The timeline of `schedule` under `costs` (checked first: an invalid schedule raises).
    overlap=True runs each of Schedule.overlapped's pairs as one (see the module docstring)."""
    check(schedule)
    paired = {r: dict(schedule.overlapped.get(r, ())) if overlap else {} for r in schedule.actions}
    latency = _exact(costs.latency)
    runs = {r: dict(batches(acts)) for r, acts in schedule.actions.items()}   # start -> end
    chunks = {r: len(schedule.stages_of(r)) for r in schedule.actions}
    sent: dict[tuple, object] = {}            # match key -> time the send was posted
    clock = {r: Fraction(0) for r in schedule.actions}
    at = {r: 0 for r in schedule.actions}
    events: list[Event] = []
    moved = True
    while moved:
        moved = False
        for r, acts in schedule.actions.items():
            while at[r] < len(acts):
                a = acts[at[r]]
                if not a.is_message:
                    if a in paired[r]:           # its BW is the next action (check.py)
                        halves = zip((a, acts[at[r] + 1]),
                                     _overlapped_pair(costs, a, paired[r][a], chunks[r]))
                    else:
                        halves = [(a, costs.of(a.kind, chunks[r]))]
                    for x, duration in halves:
                        end = clock[r] + duration
                        events.append(Event(r, x.kind, x.microbatch, x.stage, clock[r], end))
                        clock[r], at[r], moved = end, at[r] + 1, True
                    continue
                start, end = at[r], runs[r][at[r]]
                batch = acts[start:end]
                keys = [_match_key(r, m) for m in batch]
                for m, key in zip(batch, keys):
                    if m.kind.startswith("SEND"):
                        sent.setdefault(key, clock[r])
                arrivals = [sent.get(key) for m, key in zip(batch, keys)
                            if m.kind.startswith("RECV")]
                if any(t is None for t in arrivals):
                    break                      # a peer has not sent yet: come back later
                clock[r] = max([clock[r]] + [t + latency for t in arrivals])
                at[r], moved = end, True
    stuck = [r for r in schedule.actions if at[r] < len(schedule.actions[r])]
    if stuck:   # check() rules this out; kept so a bug here cannot loop or pass silently
        raise RuntimeError(f"simulate: ranks {stuck} never finished")
    events.sort(key=lambda e: (e.rank, e.start))
    return Timeline(schedule.name, schedule.pp, events)


def idle_per_rank(timeline: Timeline) -> dict[int, object]:
    """Each rank's idle time inside the whole run's span (makespan minus its busy time)."""
    return {r: timeline.makespan - timeline.busy(r) for r in range(timeline.pp)}


def gaps_per_rank(timeline: Timeline) -> dict[int, object]:
    """Each rank's idle time between its own first start and last end (the paper's bubble
    once consecutive iterations overlap the start-up skew: ZB-H2 and ZB-V make it 0)."""
    gaps = {}
    for r in range(timeline.pp):
        mine = [e for e in timeline.events if e.rank == r]
        gaps[r] = max(e.end for e in mine) - min(e.start for e in mine) - timeline.busy(r)
    return gaps


def critical_path(schedule: Schedule, timeline: Timeline) -> list[Event]:
    """The chain of events that sets the makespan of `schedule`'s simulated `timeline`, first to
    last: from the event that ends last, step back to what it waited for, an event that ends
    exactly when it starts: the producer of a tensor it received in the message batch just
    before it (F(mb, s) for RECV_F(mb, s+1), B or BW(mb, s) for RECV_B(mb, s-1)), else the
    rank's previous event. Its durations sum to the makespan: no idle on it. Where two chains
    tie, the message's producer is taken."""
    done = {(e.kind, e.microbatch, e.stage): e for e in timeline.events}
    received: dict[tuple, list[Event]] = {}          # (rank, compute action) -> producers
    for r, acts in schedule.actions.items():
        batch: list[Action] = []
        for a in acts:
            if a.is_message:
                batch.append(a)
                continue
            keys = [(F, m.microbatch, m.stage - 1) if m.kind == "RECV_F" else (k, m.microbatch, m.stage + 1)
                    for m in batch if m.kind.startswith("RECV") for k in ((F,) if m.kind == "RECV_F" else (B, BW))]
            received[(r, a.kind, a.microbatch, a.stage)] = [done[k] for k in keys if k in done]
            batch = []
    by_rank: dict[int, list[Event]] = {}
    for e in sorted(timeline.events, key=lambda e: (e.rank, e.start)):
        by_rank.setdefault(e.rank, []).append(e)
    previous = {id(b): a for events in by_rank.values() for a, b in zip(events, events[1:])}
    path = [max(timeline.events, key=lambda e: e.end)]
    while path[-1].start > min(e.start for e in timeline.events):
        e = path[-1]
        before = [d for d in received.get((e.rank, e.kind, e.microbatch, e.stage), [])
                  if d.end == e.start]
        if not before and id(e) in previous and previous[id(e)].end == e.start:
            before = [previous[id(e)]]
        if not before:
            raise RuntimeError(f"critical_path: nothing ends when {e} starts (latency > 0?)")
        path.append(before[0])
    return path[::-1]
