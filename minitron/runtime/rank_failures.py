"""How a failed run is explained: which rank died or stalled, and with what.

    RankError                 what launch and WorkerPool raise: a rank raised, died, or hung
    _raise_if_a_peer_died     a survivor's error whose root cause is a peer's death
    _raise_if_a_peer_stalled  a collective's timeout whose cause is a peer that made no progress
    _exit_reason              an exit code, or the signal that killed the rank
"""
from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import signal

from .deadline import Deadline
from .rank_process import _Rank


class RankError(RuntimeError):
    """A rank raised, died, or did not finish."""


# What a survivor's collective says when its peer's sockets closed under it: the peer is dead
# or dying, so its death is worth waiting longer for. A killed process's sockets and its sentinel
# close before the kernel reports its exit: in loaded CI runs the survivor was blamed ("rank 0
# raised: ... Connection reset by peer") for rank 1's SIGKILL (tests/test_restart.py, lesson 11).
_PEER_GONE = ("connection reset", "connection closed", "broken pipe", "end of file")


def _raise_if_a_peer_died(ranks: list[_Rank], replies: dict[int, tuple], error: str = "") -> None:
    """When a peer dies, the survivors' collectives fail too ("connection reset by peer"),
    sometimes before the parent has seen the death: look for it before blaming them, briefly
    (0.5 s), or up to 5 s when the error says the peer's connection is gone."""
    alive = [o for o in ranks if o.rank not in replies]
    if alive:
        gone = any(words in error.lower() for words in _PEER_GONE)
        ended = mp.connection.wait([o.process.sentinel for o in alive], timeout=5.0 if gone else 0.5)
        for o in alive:
            if o.process.sentinel in ended:
                # the sentinel is ready once the dying process's files close, before the kernel
                # reports its exit: wait for that, or exitcode still reads None (the race CI hit)
                o.process.join(5)
    for o in alive:
        if o.process.exitcode is not None:
            raise RankError(f"rank {o.rank} died with {_exit_reason(o.process.exitcode)} "
                            f"while in: {o.doing()}")


def _raise_if_a_peer_stalled(deadline: Deadline, timeout: float, waiter, error: str,
                             others: list) -> None:
    """A collective that timed out names the rank that waited; blame the peer that made no
    progress while it waited (stopped, frozen, or blocked outside any collective)."""
    if "timed out" not in error.lower():
        return
    stalled = deadline.stalled(others, min_idle=0.5 * timeout)
    if not stalled:
        return
    r, idle, frozen = stalled[0]
    why = ("no heartbeat either: the process is stopped, e.g. SIGSTOP or a debugger, or frozen"
           if frozen else "no CPU, no collective: blocked outside minitron.comm")
    raise RankError(f"rank {r.rank} made no progress for {idle:.0f} s ({why}) while in: "
                    f"{r.doing()}; rank {waiter.rank} timed out waiting for it:\n{error}")


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"exit code {code}"
