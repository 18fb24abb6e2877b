"""Run one function on N ranks: from a script, from pytest, from a notebook, or under torchrun.

    results = minitron.launch(fn, *args, world_size=4)   # one result per rank, rank order

On one machine `launch` forks N processes (the function may be defined in a notebook: a
forked child already has it, nothing is pickled), gives each a gloo process group (nccl when
there is one GPU per rank; MINITRON_BACKEND=gloo|nccl decides instead when set), runs fn, and
returns what each rank returned, tensors moved to the CPU. The keyword arguments world_size,
backend, timeout and echo belong to launch; every other keyword goes to fn.

What a rank prints (sys.stdout) is captured and echoed after the run, rank by rank, so
notebook output is deterministic. Everything else a rank writes (sys.stderr: warnings,
logging, tracebacks; and the C++ logs of gloo and NCCL, which bypass Python) goes to a file
per rank that is echoed only when the run fails: a library's harmless warning must not change
a notebook's graded output, and a failure shows everything. MINITRON_SHOW_STDERR=1 echoes it
always (NCCL_DEBUG=INFO, say).

Under torchrun (RANK/WORLD_SIZE/MASTER_ADDR in the environment) the same call runs fn on this
process only and returns every rank's result, gathered; the script prints what it prints
forked, once (rank 0 echoes every rank's prints; the other ranks' stdout goes to /dev/null).

Failures never hang:
  * a rank that raises makes `launch` raise `RankError` with that rank's traceback;
  * a rank that dies (killed, segfault, os._exit) is reported with its exit code and the
    operation it was in (minitron.runtime.comm publishes that to the parent);
  * a collective that a peer never joins times out after `timeout` seconds inside the rank
    and comes back as the first case, naming rank and operation (gloo raises; nccl's
    watchdog aborts the rank instead, which comes back as the second case); a peer that made
    no progress meanwhile (stopped, frozen, or blocked outside any collective) is named
    first, as the rank to look at;
  * a run in which no rank makes progress for `timeout` seconds (plus a grace of a tenth, at
    least 2 s, that lets the case above report first) is stopped, naming the ranks still
    running and what each was doing. Progress is entering or leaving a collective, or using
    the CPU (minitron/runtime/deadline.py): a long computation is never cut short, while a rank that
    sleeps, waits on a lock or a queue, or blocks outside any collective is caught.

rank_process.py holds one forked rank (process, pipe, shared status), rank_failures.py how a
failure is explained; this file starts the ranks and waits for their replies.
"""
from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import sys
import threading
import traceback
from typing import Any, Callable

import torch.distributed as dist

from . import rank_process
from .deadline import Deadline, heartbeat
from .process_group import (check_can_fork, init_process_group, launch_under_torchrun,
                            pick_backend, rendezvous_store, under_torchrun)
from .rank_failures import (RankError, _exit_reason, _raise_if_a_peer_died,
                            _raise_if_a_peer_stalled)
from .rank_output import capture_output, dumps_for_parent
from .rank_process import _enter_rank, _meet_at, _Rank

DEFAULT_TIMEOUT = float(os.environ.get("MINITRON_TIMEOUT", "120"))
_ranks_import_dynamo = False   # a rank of an earlier launch imported torch._dynamo (below)


def launch(fn: Callable, *args, world_size: int, backend: str | None = None,
           timeout: float = DEFAULT_TIMEOUT, echo: bool = True, **kwargs) -> list[Any]:
    if rank_process._in_worker:
        raise RuntimeError("launch() was called inside a launched rank: call fn directly there")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if under_torchrun():
        return launch_under_torchrun(fn, args, kwargs, world_size, backend, timeout, echo)
    backend = backend or pick_backend(world_size)
    check_can_fork(backend)
    _import_before_forking()
    ranks = [_Rank(r, world_size, log=True) for r in range(world_size)]
    store = None
    try:  # a failed start, or Ctrl-C in a notebook, must not leave the started ranks behind
        for r in ranks:
            r.start(_child_main, (r.rank, world_size, backend, timeout, fn, args, kwargs))
        store = _meet_at(rendezvous_store(timeout), ranks)  # served until the ranks are done
        return _collect(ranks, echo, timeout)
    finally:
        for r in ranks:
            r.kill()
        # Stop the store now. Kept alive by a traceback the caller holds, it would be garbage-
        # collected later, maybe in a later launch's forked rank, which has no server thread
        # for its destructor to stop (a segfault).
        store = None


def _child_main(rank, world_size, backend, timeout, fn, args, kwargs, conn, status,
                progress, log_fd, parent_pid):
    port, publish = _enter_rank(rank, world_size, conn, status, progress, parent_pid)
    out = capture_output(log_fd)
    threading.Thread(target=heartbeat, args=(progress,), daemon=True).start()
    try:
        init_process_group(backend, rank, world_size, timeout, port)
        publish("running")
        payload = ("ok", fn(*args, **kwargs))
    except BaseException:
        payload = ("error", traceback.format_exc())
    sys.stderr.flush()
    try:
        data = dumps_for_parent((*payload, out.getvalue(), "torch._dynamo" in sys.modules))
    except Exception as e:
        data = pickle.dumps(("error", f"rank {rank}'s result cannot be pickled: {e}",
                             out.getvalue()))
    conn.send_bytes(data)
    try:
        conn.recv_bytes()  # the parent says when everyone is done; then tear down together
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:
        pass
    sys.stderr.flush()
    os._exit(0)  # never run the parent's atexit handlers (a Jupyter kernel's, say)


# ----------------------------------------------------------------------------------------
# The parent: collect the replies, or the first failure, within the run's deadline
# ----------------------------------------------------------------------------------------
def _collect(ranks: list[_Rank], echo: bool, timeout: float) -> list[Any]:
    replies: dict[int, tuple] = {}
    try:
        _wait_for_replies(ranks, replies, timeout)
    except RankError:
        _echo(ranks, replies, echo, failed=True)
        raise
    for r in ranks:
        try:
            r.parent_conn.send_bytes(b"done")
        except OSError:
            pass
    for r in ranks:
        r.process.join(10)
    _echo(ranks, replies, echo, failed=False)
    global _ranks_import_dynamo
    _ranks_import_dynamo |= any(reply[3:] == (True,) for reply in replies.values())
    return [replies[r.rank][1] for r in ranks]


def _wait_for_replies(ranks: list[_Rank], replies: dict[int, tuple], timeout: float) -> None:
    pending = {r.parent_conn: r for r in ranks}
    sentinels = {r.process.sentinel: r for r in ranks}
    deadline = Deadline(ranks, timeout)
    while pending:
        ready = mp.connection.wait([*pending, *sentinels], timeout=1.0)
        if ready:
            deadline.progress()
        elif deadline.passed():
            stuck = "\n".join(f"  rank {r.rank}: {r.doing()}" for r in pending.values())
            done = f"ranks {sorted(replies)} finished; " if replies else ""
            raise RankError(f"no rank communicated or computed for {deadline.limit:.0f} s "
                            f"({deadline.rule(timeout)}): {done}these were still running:\n{stuck}")
        for obj in ready:
            if obj in pending:
                r = pending.pop(obj)
                try:
                    replies[r.rank] = pickle.loads(obj.recv_bytes())
                except EOFError:  # died before replying
                    r.process.join()
                    raise RankError(f"rank {r.rank} died with {_exit_reason(r.process.exitcode)} "
                                    f"while in: {r.doing()}") from None
                sentinels.pop(r.process.sentinel, None)
                if replies[r.rank][0] == "error":
                    _raise_if_a_peer_died(ranks, replies, str(replies[r.rank][1]))  # then that death is the root cause
                    _raise_if_a_peer_stalled(deadline, timeout, r, replies[r.rank][1],
                                             [o for o in ranks if o.rank not in replies])
                    others = [f"  rank {o.rank}: {o.doing()}" for o in ranks
                              if o.rank not in replies]
                    waiting = ("\nThe other ranks were stopped while doing:\n" + "\n".join(others)
                               if others else "")
                    raise RankError(f"rank {r.rank} raised:\n{replies[r.rank][1]}{waiting}")
            elif obj in sentinels:
                r = sentinels.pop(obj)
                if r.parent_conn in pending and not r.parent_conn.poll():
                    r.process.join()
                    raise RankError(f"rank {r.rank} died with {_exit_reason(r.process.exitcode)} "
                                    f"while in: {r.doing()}")


def _echo(ranks: list[_Rank], replies: dict[int, tuple], echo: bool, failed: bool) -> None:
    """Each rank's prints, in rank order; its log too when the run failed (or when asked)."""
    if not echo:
        return
    show_log = failed or os.environ.get("MINITRON_SHOW_STDERR", "0") not in ("", "0")
    for r in ranks:
        out = replies[r.rank][2] if r.rank in replies else ""
        err = r.log() if show_log else ""
        for text, stream in ((out, sys.stdout), (err, sys.stderr)):
            for line in text.splitlines():
                print(f"[rank {r.rank}] {line}", file=stream)


def ranks_will_build_optimizers() -> None:
    """Say that the next launches' ranks each build a torch optimizer (the training engine does):
    torch._dynamo, which its first construction imports, is then imported here once, before
    forking, rather than in every rank. Call it after whatever decides how triton is first
    imported (model.fused.enable_kernels): torch._dynamo imports triton."""
    global _ranks_import_dynamo
    _ranks_import_dynamo = True


def _import_before_forking() -> None:
    """torch imports torch._dynamo lazily (at an optimizer's construction, under a dispatch
    mode): 1.3 s of CPU (torch 2.13, a 2-core EPYC) in every forked rank of every launch
    that needs it. Once the ranks of a launch have needed it, it is imported here, once, and
    the next launches' ranks inherit it; a process whose ranks never need it never pays for
    it."""
    if _ranks_import_dynamo:
        import torch._dynamo  # noqa: F401
