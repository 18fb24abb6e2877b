"""A pool of ranks that stays up: tests run hundreds of small jobs without paying for process
start-up and process-group set-up each time. The ranks are forked and guarded as launch's are."""
from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import threading
import traceback
from typing import Any, Callable

from .deadline import Deadline, heartbeat
from .launch import DEFAULT_TIMEOUT
from .rank_failures import RankError, _exit_reason, _raise_if_a_peer_died, _raise_if_a_peer_stalled
from .rank_process import _enter_rank, _meet_at, _Rank
from .process_group import check_can_fork, init_process_group, pick_backend, rendezvous_store
from .rank_output import dumps_for_parent


class WorkerPool:
    """`pool.run(fn, *args)` runs fn on every rank of a long-lived world, returns the results.

    fn and args are pickled, so fn must be importable (a module-level function). If any rank
    fails, the whole pool is torn down (its collectives may be out of step) and the error is
    raised; the next `run` starts a fresh world.
    """

    def __init__(self, world_size: int, backend: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT):
        self.world_size, self.timeout = world_size, timeout
        self.backend = backend or pick_backend(world_size)
        self.ranks: list[_Rank] = []
        self.store = None   # where the ranks met; served as long as they live (new_group meets there)

    def _start(self):
        check_can_fork(self.backend)
        self.ranks = [_Rank(r, self.world_size) for r in range(self.world_size)]
        try:
            for r in self.ranks:
                r.start(_pool_main, (r.rank, self.world_size, self.backend, self.timeout))
            self.store = _meet_at(rendezvous_store(self.timeout), self.ranks)
        except BaseException:
            self.close()
            raise

    def run(self, fn: Callable, *args, **kwargs) -> list[Any]:
        if not self.ranks:
            self._start()
        job = pickle.dumps((fn, args, kwargs))
        for r in self.ranks:
            r.parent_conn.send_bytes(job)
        try:
            return self._collect()
        except BaseException:
            self.close()
            raise

    def _collect(self) -> list[Any]:
        """Every rank's reply, or the first failure: wait on all ranks at once, so a rank that
        raised is reported, not a peer left waiting for it in a collective. A rank's death
        shows on its process sentinel (the other ranks hold copies of its pipe)."""
        pending, replies = set(self.ranks), {}
        deadline = Deadline(self.ranks, self.timeout)   # as launch's: no progress, no patience
        while pending:
            waits = {obj: r for r in pending for obj in (r.parent_conn, r.process.sentinel)}
            ready = mp.connection.wait(list(waits), 1.0)
            if ready:
                deadline.progress()
            elif deadline.passed():
                stuck = "; ".join(f"rank {r.rank}: {r.doing()}" for r in sorted(pending, key=lambda r: r.rank))
                raise RankError(f"no rank communicated or computed for {deadline.limit:.0f} s "
                                f"({deadline.rule(self.timeout)}): {stuck}")
            for r in sorted({waits[obj] for obj in ready}, key=lambda r: r.rank):
                pending.discard(r)
                try:
                    if not r.parent_conn.poll():
                        raise EOFError
                    status, value = pickle.loads(r.parent_conn.recv_bytes())
                except EOFError:
                    r.process.join(5)
                    raise RankError(f"rank {r.rank} died with {_exit_reason(r.process.exitcode)} "
                                    f"while in: {r.doing()}") from None
                if status == "error":
                    _raise_if_a_peer_died(list(pending), {}, str(value))  # then that death is the root cause
                    _raise_if_a_peer_stalled(deadline, self.timeout, r, value, sorted(
                        pending, key=lambda o: o.rank))
                    raise RankError(f"rank {r.rank} raised:\n{value}")
                replies[r.rank] = value
        return [replies[r.rank] for r in self.ranks]

    def close(self):
        for r in self.ranks:
            r.kill()
        self.ranks, self.store = [], None


def _pool_main(rank, world_size, backend, timeout, conn, status, progress, log_fd, parent_pid):
    # Output is not captured: pytest captures it per test (log_fd is None: pool ranks have none).
    port, publish = _enter_rank(rank, world_size, conn, status, progress, parent_pid)
    threading.Thread(target=heartbeat, args=(progress,), daemon=True).start()
    init_process_group(backend, rank, world_size, timeout, port)
    while True:
        publish("waiting for a job")
        try:
            job = conn.recv_bytes()
        except EOFError:
            os._exit(0)
        publish("running")
        try:
            fn, args, kwargs = pickle.loads(job)
            reply = ("ok", fn(*args, **kwargs))
        except BaseException:
            reply = ("error", traceback.format_exc())
        try:
            data = dumps_for_parent(reply)
        except Exception as e:
            data = pickle.dumps(("error", f"rank {rank}'s result cannot be pickled: {e}"))
        conn.send_bytes(data)
