"""DualPipeV's overlapped pairs run as one: one half's all-to-all in flight while the other computes.

A pair (Schedule.overlapped) is the forward of one micro-batch on one chunk and the full
backward of another micro-batch on the rank's other chunk. Every MoE layer of either half
stops at its all-to-alls (the counts, the dispatch and the combine; in backward their
adjoints), and without overlap the rank stands idle while the bytes travel. DeepSeek-V3 cuts
both halves into pieces by hand and gives the communication its own SMs. Here the two halves
run as two threads that share one *turn* (`Turns`): only the holder computes. At each
all-to-all a half:

  1. starts it asynchronously (comm.all_to_all with this thread's hook: async_op=True, so
     gloo's own threads, or NCCL's stream, move the bytes),
  2. hands the turn to the other half, which computes until its own next all-to-all (or its
     end) and hands the turn back,
  3. waits for its collective (often already done: then nothing is exposed) and goes on.

Why it is exact: every tensor operation is the one the sequential run does, on the same inputs;
the two halves touch different stages (their own parameters and gradients), and only the turn
holder runs Python at all. Why it cannot deadlock or mismatch: a rank starts its collectives
only while it holds the turn, and the turns pass at the same points on every rank of a group,
so all ranks start the same collectives in the same order (gloo and NCCL match by order).

`recording()` collects, on time.perf_counter's clock, every half's compute segments and every
all-to-all it started, with when it finished (the work's future, else the end of its wait):
what `python -m minitron.bench dualpipev` measures the hidden share from.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

import torch

from ..runtime import comm, comm_async
from ..runtime.recorder import Recorder

# ---- the measured timeline ---------------------------------------------------------------
_timeline = Recorder()


def recording():
    """`with recording() as segments:` collects ("compute" | "all_to_all", action, start, end):
    a half's compute between its all-to-alls, and each all-to-all from start to finish.
    While recording, the actions outside pairs are timed the same way (their all-to-alls
    started and waited for at once), so a run without overlap gives the same kind of timeline."""
    return _timeline.recording()


_record = _timeline.record


# ---- one turn between two halves ---------------------------------------------------------
class Turns:
    """Which of two halves may compute; half 0 starts. A half that has finished gives the
    turn away for good, so the other runs to its end without handing it back."""

    def __init__(self):
        self._cond = threading.Condition()
        self._holder = 0
        self._done = [False, False]

    def wait_for(self, me: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._holder == me)

    def hand_over(self, me: int) -> None:
        """Give the turn to the other half (if it is still running) and wait for it back."""
        with self._cond:
            if self._done[1 - me]:
                return
            self._holder = 1 - me
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._holder == me)

    def finish(self, me: int) -> None:
        with self._cond:
            self._done[me] = True
            self._holder = 1 - me
            self._cond.notify_all()


class _Half:
    """One action's work on one thread: its compute segments, its all-to-alls in flight."""

    def __init__(self, label: str, turns: Turns | None, me: int):
        self.label, self.turns, self.me = label, turns, me
        self.resumed = self.start = self.end = 0.0

    def in_flight(self, op: str, group: comm.Group, work, out: torch.Tensor) -> None:
        """comm's hook: the all-to-all has started; let the other half compute, then wait."""
        pending = comm_async.Pending(op, group, work, out)
        _record("compute", self.label, self.resumed, pending.started)
        if self.turns is not None:
            self.turns.hand_over(self.me)
        pending.wait()
        _record("all_to_all", self.label, pending.started, pending.finished)
        self.resumed = time.perf_counter()

    def run(self, work: Callable[[], None]) -> None:
        if self.turns is not None:
            self.turns.wait_for(self.me)
        previous = comm.set_in_flight_hook(self.in_flight)
        self.start = self.resumed = time.perf_counter()
        try:
            work()
        finally:
            self.end = time.perf_counter()
            _record("compute", self.label, self.resumed, self.end)
            comm.set_in_flight_hook(previous)
            if self.turns is not None:
                self.turns.finish(self.me)


def run_pair(first: tuple[str, Callable[[], None]], second: tuple[str, Callable[[], None]],
             device: torch.device) -> list[tuple[float, float]]:
    """Run two (label, work) halves as one overlapped pair (the module docstring): `first` on
    this thread, `second` on a helper thread. Returns each half's (start, end)."""
    turns = Turns()
    halves = [_Half(first[0], turns, 0), _Half(second[0], turns, 1)]
    errors: list[BaseException] = []

    def second_half() -> None:
        if device.type == "cuda":
            torch.cuda.set_device(device)          # the current device is per thread
        try:
            halves[1].run(second[1])
        except BaseException as e:                 # raised on the calling thread below
            errors.append(e)

    helper = threading.Thread(target=second_half, name=f"pair {second[0]}", daemon=True)
    helper.start()
    try:
        halves[0].run(first[1])
    finally:
        helper.join()
    if errors:
        raise errors[0]
    return [(h.start, h.end) for h in halves]


def run_alone(label: str, work: Callable[[], None]) -> None:
    """One action outside a pair; while recording, timed like a half (its all-to-alls waited
    for at once), else simply run."""
    if not _timeline:
        return work()
    _Half(label, None, 0).run(work)


def hides_all_to_all(model) -> bool:
    """Whether the model's stages have all-to-alls that an overlapped pair can hide: experts
    whose tokens travel over tp x ep ranks (moe/dispatch.py)."""
    return bool(model.cfg.n_experts) and model.grid.tp_ep.size > 1
