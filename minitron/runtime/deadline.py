"""The deadline of a launched run: no progress for `timeout` seconds means it hangs.

A collective that a peer never joins times out inside the rank. A rank can also hang outside
any collective (a sleep, a lock, a queue, input()), and then nothing inside it ever raises. A
fixed deadline for the whole run cannot tell that from a long computation, so the parent
watches for progress instead: a rank entering or leaving a collective (its published status
changes), or using the CPU (a heartbeat thread publishes its CPU seconds). A rank that spins
forever without communicating looks like work, and is left to the user's interrupt.

When a rank's collective times out, the rank to blame is rarely the one that waited: `stalled`
names the peers that made no progress meanwhile, and which of them stopped beating at all
(the heartbeat thread also publishes when it last ran: a SIGSTOPped or frozen process).
"""
from __future__ import annotations

import time

HEARTBEAT_S = 0.5   # how often a rank publishes its CPU seconds
_BUSY = 0.02        # a rank using more than 2% of a core is working (a sleeping one uses 0.05%)


FROZEN_S = 4 * HEARTBEAT_S   # no beat for this long: the process is stopped or frozen


def heartbeat(progress) -> None:
    """Publish this process's CPU seconds (all its threads), so the parent tells work from a
    hang, and when it last did (CLOCK_MONOTONIC is the machine's: the parent can compare)."""
    while True:
        progress[1] = time.process_time()
        progress[2] = time.monotonic()
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
        self.active_at = [self.last_check] * len(ranks)   # per rank: its last progress

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
        for i, ((changes, cpu), (changes0, cpu0)) in enumerate(zip(sample, self.seen)):
            if changes != changes0 or cpu - cpu0 > busy:
                self.active_at[i] = self.last_progress = now
        self.seen, self.last_check = sample, now
        return now - self.last_progress > self.limit

    def stalled(self, ranks: list, min_idle: float) -> list[tuple]:
        """(rank, seconds idle, frozen) of those `ranks` with no progress for min_idle seconds
        that are to blame: frozen ones (no heartbeat), and live ones outside any collective (a
        live rank waiting inside one is a fellow waiter). Frozen ones first."""
        self.passed()                               # bring active_at up to now
        now, out = time.monotonic(), []
        for r in ranks:
            idle = now - self.active_at[self.ranks.index(r)]
            beat = r.progress[2]
            frozen = beat > 0 and now - beat > FROZEN_S
            waiting = not r.doing().startswith(("running", "starting up"))
            if idle >= min_idle and (frozen or not waiting):
                out.append((r, idle, frozen))
        return sorted(out, key=lambda t: (not t[2], t[0].rank))
