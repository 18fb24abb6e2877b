"""The deadline of a launched run: no progress for `timeout` seconds means it hangs.

A collective that a peer never joins times out inside the rank. A rank can also hang outside
any collective (a sleep, a lock, a queue, input()), and then nothing inside it ever raises. A
fixed deadline for the whole run cannot tell that from a long computation, so the parent
watches for progress instead: a rank entering or leaving a collective (its published status
changes), or using the CPU (a heartbeat thread publishes its CPU seconds). A rank that spins
forever without communicating looks like work, and is left to the user's interrupt.
"""
from __future__ import annotations

import time

HEARTBEAT_S = 0.5   # how often a rank publishes its CPU seconds
_BUSY = 0.02        # a rank using more than 2% of a core is working (a sleeping one uses 0.05%)


def heartbeat(progress) -> None:
    """Publish this process's CPU seconds (all its threads): the parent tells work from a hang."""
    while True:
        progress[1] = time.process_time()
        time.sleep(HEARTBEAT_S)


class Deadline:
    """A run is hung when no rank has made progress for `timeout` seconds plus a grace.

    Progress: a reply, or a rank entering or leaving a collective (its status changed), or
    using the CPU. The grace (a tenth of timeout, at least 2 s) lets a stuck collective's own
    timeout, inside the rank, report first, with its traceback."""

    def __init__(self, ranks: list, timeout: float):
        self.ranks, self.limit = ranks, timeout + max(2.0, 0.1 * timeout)
        self.last_progress = self.last_check = time.monotonic()
        self.seen = self._sample()

    def _sample(self) -> list[tuple[float, float]]:
        return [(r.progress[0], r.progress[1]) for r in self.ranks]

    @staticmethod
    def rule(timeout: float) -> str:
        return f"timeout={timeout:g} s and a grace; pass timeout= or set MINITRON_TIMEOUT"

    def progress(self) -> None:
        self.last_progress = time.monotonic()

    def passed(self) -> bool:
        now, sample = time.monotonic(), self._sample()
        busy = _BUSY * (now - self.last_check)
        if any(changes != changes0 or cpu - cpu0 > busy
               for (changes, cpu), (changes0, cpu0) in zip(sample, self.seen)):
            self.last_progress = now
        self.seen, self.last_check = sample, now
        return now - self.last_progress > self.limit
