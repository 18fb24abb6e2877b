"""Check a schedule before anything runs: complete, in dependency order, matched, deadlock-free.

`check(schedule)` raises ScheduleError (a ValueError) naming the rank, the action's index in
that rank's list and what is wrong; otherwise it returns a CheckReport with each rank's peak
activation memory. What must hold:

1. Completeness. Every (micro-batch, stage) has exactly one F and either one BW or one B and
   one W, all on the stage's rank (Schedule.stage_rank).
2. Local order. On its rank: F before B before W (or F before BW). A rank cannot use what it
   has not made or received: F of stage s needs F of s-1 before it on this rank or, if s-1
   lives elsewhere, a RECV_F of it; B/BW of s needs B/BW of s+1 or a RECV_B likewise. A send
   must come after the compute that makes its tensor.
3. Matching. Each SEND_F of stage s from rank a to rank b has exactly one RECV_F of stage s+1
   on b from a (and SEND_B of s one RECV_B of s-1), and every peer is the stage's real rank.
   Between two ranks they come in the same order on both ends: backends match messages by
   posting order, not by content, and the tensors all have one shape.
4. No deadlock. Consecutive messages on a rank are one batch (batch_isend_irecv). Under
   rendezvous semantics, the strictest a backend may be, a batch completes only once every
   op's counterpart has been posted by the peer. Stepping all ranks until none can move either
   finishes every list or leaves stuck ranks, which the error lists with what each waits for.
   Since receives come only after their sends' data is made (2.), a finished run proves the
   data dependencies across ranks too (F of s after F of s-1, B of s after B of s+1).
5. Overlapped pairs (Schedule.overlapped, DualPipeV). Each is an F and a backward (BW or B) of
   another stage of the same rank, the backward directly after the F with no message between:
   a GPU runs the two as one unit, so neither may wait for anything the other's start needs.

Memory. A micro-batch's activations on a stage are alive from its F until its W (or BW). On a
rank holding v stages each chunk is 1/v of a stage, so it counts 1/v: the peak is in units of
a full stage's activations for one micro-batch. GPipe's peak is m; 1F1B's first rank p.
"""
from __future__ import annotations

import dataclasses
from fractions import Fraction

from .actions import (B, BW, COMPUTE, F, RECV_B, RECV_F, SEND_B, SEND_F, W, Action,
                      Schedule)


class ScheduleError(ValueError):
    """A schedule that cannot run; the message names the rank and the action."""


@dataclasses.dataclass(frozen=True)
class CheckReport:
    name: str
    peak_activations: dict[int, Fraction]    # rank -> peak alive micro-batches, in stage units
    batches: dict[int, int]                  # rank -> number of message batches it posts

    @property
    def peak(self) -> Fraction:
        return max(self.peak_activations.values())


def _where(rank: int, index: int, action: Action) -> str:
    return f"rank {rank}, action {index} ({action})"


def _check_shape(schedule: Schedule) -> None:
    n, pp = schedule.n_stages, schedule.pp
    if len(schedule.stage_rank) != n or sorted(set(schedule.stage_rank)) != list(range(pp)):
        raise ScheduleError(f"{schedule.name}: stage_rank {schedule.stage_rank} must give each of "
                            f"the {n} stages a rank and use every rank 0..{pp - 1}")
    if sorted(schedule.actions) != list(range(pp)):
        raise ScheduleError(f"{schedule.name}: actions must have one list per rank 0..{pp - 1}, "
                            f"got ranks {sorted(schedule.actions)}")
    for rank, actions in schedule.actions.items():
        for i, a in enumerate(actions):
            if not (0 <= a.stage < n and 0 <= a.microbatch < schedule.microbatches):
                raise ScheduleError(f"{_where(rank, i, a)}: stage must be in 0..{n - 1} and "
                                    f"micro-batch in 0..{schedule.microbatches - 1}")
            if schedule.stage_rank[a.stage] != rank:
                raise ScheduleError(f"{_where(rank, i, a)}: stage {a.stage} lives on rank "
                                    f"{schedule.stage_rank[a.stage]}, not here")
            if a.is_message:
                other = a.stage + 1 if a.kind in (SEND_F, RECV_B) else a.stage - 1
                if not 0 <= other < n or schedule.stage_rank[other] != a.peer or a.peer == rank:
                    raise ScheduleError(f"{_where(rank, i, a)}: the neighbouring stage {other} "
                                        f"is not on another rank {a.peer}")


def _check_complete_and_ordered(schedule: Schedule) -> None:
    last = schedule.n_stages - 1
    for rank, actions in schedule.actions.items():
        seen: dict[tuple[str, int, int], int] = {}
        for i, a in enumerate(actions):
            key = (a.kind, a.microbatch, a.stage)
            if key in seen:
                raise ScheduleError(f"{_where(rank, i, a)}: repeats action {seen[key]}")
            s, mb = a.stage, a.microbatch
            here = schedule.stage_rank

            def need(kind, stage, what):
                if (kind, mb, stage) not in seen:
                    raise ScheduleError(f"{_where(rank, i, a)}: comes before {what}")
            if a.kind == F and s > 0:
                need(F if here[s - 1] == rank else RECV_F, s - 1 if here[s - 1] == rank else s,
                     f"its input (F{mb} of stage {s - 1}" + ("" if here[s - 1] == rank else
                                                             ", received") + ")")
            if a.kind in (B, BW):
                need(F, s, f"its F{mb}@s{s}")
                if s < last and here[s + 1] == rank:
                    if (B, mb, s + 1) not in seen and (BW, mb, s + 1) not in seen:
                        raise ScheduleError(f"{_where(rank, i, a)}: comes before the backward "
                                            f"of stage {s + 1} that makes its gradient")
                elif s < last:
                    need(RECV_B, s, f"RECV_B{mb}@s{s}, the gradient it needs")
            if a.kind == W:
                need(B, s, f"its B{mb}@s{s}")
            if a.kind == SEND_F:
                need(F, s, f"the F{mb}@s{s} that makes what it sends")
            if a.kind == SEND_B and (B, mb, s) not in seen and (BW, mb, s) not in seen:
                raise ScheduleError(f"{_where(rank, i, a)}: comes before the backward that "
                                    f"makes what it sends")
            seen[key] = i
        for s in schedule.stages_of(rank):
            for mb in range(schedule.microbatches):
                has = {k for k in COMPUTE if (k, mb, s) in seen}
                if has not in ({F, BW}, {F, B, W}):
                    raise ScheduleError(f"{schedule.name}: rank {rank}, micro-batch {mb} of stage "
                                        f"{s}: {_what_is_wrong(has)} (has {sorted(has)})")


def _what_is_wrong(has: set[str]) -> str:
    if F not in has:
        return "lacks its F"
    if has == {F}:
        return "lacks its backward (BW, or B and W)"
    if BW in has:
        return "has both a BW and a split B/W"
    return "lacks its W" if B in has else "lacks its B"


def _match_key(rank: int, a: Action) -> tuple:
    """The same key for a send and the receive that takes it."""
    if a.kind == SEND_F:
        return ("F", a.microbatch, a.stage, rank, a.peer)
    if a.kind == RECV_F:
        return ("F", a.microbatch, a.stage - 1, a.peer, rank)
    if a.kind == SEND_B:
        return ("B", a.microbatch, a.stage, rank, a.peer)
    return ("B", a.microbatch, a.stage + 1, a.peer, rank)   # RECV_B


def _check_matched(schedule: Schedule) -> None:
    sends, recvs = {}, {}
    for rank, actions in schedule.actions.items():
        for i, a in enumerate(actions):
            if a.is_message:
                (sends if a.kind.startswith("SEND") else recvs)[_match_key(rank, a)] = (rank, i, a)
    for mine, theirs, verb in ((sends, recvs, "receives"), (recvs, sends, "sends")):
        for key, (rank, i, a) in mine.items():
            if key not in theirs:
                raise ScheduleError(f"{_where(rank, i, a)}: no action on rank {a.peer} {verb} it")
    # NCCL and gloo match the messages from one rank to another by posting order, not content:
    # a receiver listing them in another order would get the tensors swapped (same shapes).
    pairs: dict[tuple[int, int], dict[str, list]] = {}
    for table, side in ((sends, "send"), (recvs, "recv")):
        for key, where in sorted(table.items(), key=lambda kv: kv[1][:2]):
            pairs.setdefault((key[3], key[4]), {"send": [], "recv": []})[side].append((key, where))
    for (src, dst), both in sorted(pairs.items()):
        for n, ((k_send, _), (k_recv, (rank, i, a))) in enumerate(zip(both["send"], both["recv"])):
            if k_send != k_recv:
                sent = both["send"][n][1][2]
                raise ScheduleError(f"{_where(rank, i, a)}: is rank {dst}'s receive number {n} from "
                                    f"rank {src}, whose send number {n} is {sent}; messages "
                                    f"between two ranks are matched in posting order, so list "
                                    f"them in the same order on both")


def batches(actions: tuple[Action, ...]) -> list[tuple[int, int]]:
    """[start, end) index ranges of the runs of consecutive messages: one batch each."""
    runs, start = [], None
    for i, a in enumerate(actions + (Action(F, 0, 0),)):
        if a.is_message and start is None:
            start = i
        elif not a.is_message and start is not None:
            runs.append((start, i))
            start = None
    return runs


def _check_no_deadlock(schedule: Schedule) -> dict[int, int]:
    runs = {r: batches(acts) for r, acts in schedule.actions.items()}
    done = {r: 0 for r in runs}                 # batches completed per rank
    posted_sends, posted_recvs = set(), set()
    key = {}
    for r, acts in schedule.actions.items():
        for i, a in enumerate(acts):
            if a.is_message:
                key[r, i] = _match_key(r, a)
    moved = True
    while moved:
        moved = False
        for r, rs in runs.items():
            while done[r] < len(rs):
                start, end = rs[done[r]]
                for i in range(start, end):          # posting is non-blocking
                    posted = posted_sends if schedule.actions[r][i].kind.startswith("SEND") \
                        else posted_recvs
                    moved |= key[r, i] not in posted     # a new post may free a peer
                    posted.add(key[r, i])
                if not all(key[r, i] in (posted_recvs if schedule.actions[r][i].kind
                                         .startswith("SEND") else posted_sends)
                           for i in range(start, end)):
                    break
                done[r] += 1
                moved = True
    stuck = [r for r in runs if done[r] < len(runs[r])]
    if stuck:
        lines = []
        for r in stuck:
            start, end = runs[r][done[r]]
            waits = []
            for i in range(start, end):
                a = schedule.actions[r][i]
                sending = a.kind.startswith("SEND")
                if key[r, i] not in (posted_recvs if sending else posted_sends):
                    waits.append(f"rank {a.peer} to post the {'receive' if sending else 'send'}"
                                 f" for {a} (action {i})")
            lines.append(f"rank {r} is stuck at actions {start}..{end - 1}, waiting for "
                         + " and ".join(waits))
        raise ScheduleError(f"{schedule.name} deadlocks (a batch completes only when every peer "
                            f"has posted its counterpart): " + "; ".join(lines))
    return {r: len(rs) for r, rs in runs.items()}


def peak_activations(schedule: Schedule) -> dict[int, Fraction]:
    """Per rank, the most micro-batches alive at once (F until W or BW), in full-stage units."""
    peaks = {}
    for rank in schedule.actions:
        unit = Fraction(1, len(schedule.stages_of(rank)))
        alive = peak = Fraction(0)
        for a in schedule.compute(rank):
            alive += unit if a.kind == F else (-unit if a.kind in (W, BW) else 0)
            peak = max(peak, alive)
        peaks[rank] = peak
    return peaks


def _check_overlapped(schedule: Schedule) -> None:
    for rank, pairs in schedule.overlapped.items():
        actions = schedule.actions.get(rank, ())
        for f, b in pairs:
            where = f"{schedule.name}: rank {rank}, overlapped pair ({f}, {b})"
            if f.kind != F or b.kind not in (B, BW) or f.stage == b.stage:
                raise ScheduleError(f"{where}: must be an F and a backward of another stage")
            if f not in actions:
                raise ScheduleError(f"{where}: {f} is not in the rank's actions")
            i = actions.index(f)
            if i + 1 >= len(actions) or actions[i + 1] != b:
                nxt = actions[i + 1] if i + 1 < len(actions) else "nothing"
                raise ScheduleError(f"{where}: the backward must directly follow the F "
                                    f"(action {i + 1} is {nxt})")


def check(schedule: Schedule) -> CheckReport:
    """Validate `schedule` (see the module docstring) or raise ScheduleError saying where."""
    _check_shape(schedule)
    _check_overlapped(schedule)
    _check_complete_and_ordered(schedule)
    _check_matched(schedule)
    n_batches = _check_no_deadlock(schedule)
    return CheckReport(schedule.name, peak_activations(schedule), n_batches)
