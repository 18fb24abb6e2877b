"""Each rank's sends and receives, derived from the compute orders of a schedule
(schedules.py and dualpipev.py decide only who computes what, in which order).

with_messages adds a SEND_F after each F whose next stage is on another rank and the matching
RECV_F on that rank, a SEND_B/RECV_B pair for each B or BW whose previous stage is elsewhere.
Each message is placed on both ranks at the moment its tensor is made in an as-soon-as-possible
run, so a send follows its producer and a receive comes before its consumer.
"""
from __future__ import annotations

from .actions import B, BW, F, RECV_B, RECV_F, SEND_B, SEND_F, W, Action, Schedule


def _awaited(a: Action, last: int) -> tuple[str, int, int] | None:
    """The tensor `a` waits for: a forward the previous stage's output, a backward (B or BW) the
    next stage's input gradient; None for stage 0's F, the last stage's B, and every W (which
    needs only what its own B saved, earlier on this rank)."""
    if a.kind == F and a.stage > 0:
        return ("F", a.microbatch, a.stage - 1)
    if a.kind in (B, BW) and a.stage < last:
        return ("B", a.microbatch, a.stage + 1)
    return None


def _compute_times(stage_rank: tuple[int, ...], compute: dict[int, list[Action]],
                   overlapped: dict[int, tuple[tuple[Action, Action], ...]] | None = None):
    """Start and end of every compute action when each runs as soon as its inputs exist
    (F = B = W = 1, BW = 2, messages free). An overlapped (F, BW) pair is one unit: it starts
    once both inputs exist and both halves end together. Raises ValueError if the orders wait
    on each other."""
    last, cost = len(stage_rank) - 1, {F: 1, B: 1, W: 1, BW: 2}
    paired = {r: {f: b for f, b in (overlapped or {}).get(r, ())} for r in compute}
    ready: dict[tuple[str, int, int], int] = {}   # ("F"|"B", mb, stage) -> when made
    times: dict[int, list[tuple[int, int]]] = {r: [] for r in compute}
    clock = {r: 0 for r in compute}
    moved = True
    while moved:      # sweep the ranks until none can start its next action
        moved = False
        for r, order in compute.items():
            while len(times[r]) < len(order):
                a = order[len(times[r])]
                unit = [a, paired[r][a]] if a in paired[r] else [a]
                awaited = [w for w in (_awaited(x, last) for x in unit) if w is not None]
                if any(w not in ready for w in awaited):
                    break                             # another rank must make it first
                start = max([clock[r]] + [ready[w] for w in awaited])
                clock[r] = start + sum(cost[x.kind] for x in unit)
                for x in unit:
                    times[r].append((start, clock[r]))
                    if x.kind != W:                   # F hands on its output, B/BW dL/dinput
                        ready["F" if x.kind == F else "B", x.microbatch, x.stage] = clock[r]
                moved = True
    stuck = {r: str(order[len(times[r])]) for r, order in compute.items() if len(times[r]) < len(order)}
    if stuck:
        raise ValueError(f"compute orders wait on each other forever; each rank's next action: {stuck}")
    return times


def with_messages(name: str, pp: int, microbatches: int, virtual: int,
                  stage_rank: tuple[int, ...], compute: dict[int, list[Action]],
                  overlapped: dict[int, tuple[tuple[Action, Action], ...]] | None = None) -> Schedule:
    """Add each rank's sends and receives to its compute order, deadlock-free by construction.

    Every message is stamped with the time its tensor is made in an as-soon-as-possible run of
    the compute orders (ties broken the same way everywhere); both ends place it at that time:
    after every compute that started earlier, before every compute that starts at or after it,
    so every rank posts its messages in one global order. Then no deadlock is possible, even
    under rendezvous: the earliest message not yet posted by both ends is reached by both,
    because everything before it on each end has been matched.
    An overlapped pair (F, BW) starts and ends as one unit, so no message falls between them:
    both inputs are received before it, both outputs sent after it.
    """
    last = len(stage_rank) - 1
    times = _compute_times(stage_rank, compute, overlapped)
    made = {(a.kind, a.microbatch, a.stage): end        # when each compute's tensor exists
            for r, order in compute.items() for a, (_, end) in zip(order, times[r])}
    messages: dict[int, list[tuple[tuple, Action]]] = {r: [] for r in compute}
    for r, order in compute.items():
        for a in order:
            s, mb = a.stage, a.microbatch
            if a.kind == F and s < last and stage_rank[s + 1] != r:
                key = (made[F, mb, s], 0, mb, s)
                messages[r].append((key, Action(SEND_F, mb, s, stage_rank[s + 1])))
                messages[stage_rank[s + 1]].append((key, Action(RECV_F, mb, s + 1, r)))
            if a.kind in (B, BW) and s > 0 and stage_rank[s - 1] != r:
                key = (made[a.kind, mb, s], 1, mb, s)
                messages[r].append((key, Action(SEND_B, mb, s, stage_rank[s - 1])))
                messages[stage_rank[s - 1]].append((key, Action(RECV_B, mb, s - 1, r)))
    actions = {}
    for r, order in compute.items():
        pending = sorted(messages[r], key=lambda km: km[0])
        out = []
        for a, (start, _) in zip(order, times[r]):
            while pending and pending[0][0][0] <= start:
                out.append(pending.pop(0)[1])
            out.append(a)
        actions[r] = tuple(out + [msg for _, msg in pending])
    return Schedule(name, pp, microbatches, virtual, tuple(stage_rank), actions,
                    dict(overlapped or {}))


__all__ = ["with_messages"]
