"""Run one function on N ranks: from a script, from pytest, from a notebook, or under torchrun.

    results = minitron.launch(fn, *args, world_size=4)   # one result per rank, rank order

On one machine `launch` forks N processes (the function may be defined in a notebook: a
forked child already has it, nothing is pickled), gives each a gloo process group (nccl when
there is one GPU per rank; MINITRON_BACKEND=gloo|nccl decides instead when set), runs fn, and
returns what each rank returned, tensors moved to the CPU. What a rank prints is captured and
echoed after the run, rank by rank, so notebook output is deterministic. The keyword
arguments world_size, backend, timeout and echo belong to launch; every other keyword goes
to fn.

Under torchrun (RANK/WORLD_SIZE/MASTER_ADDR in the environment) the same call runs fn on this
process only and returns every rank's result, gathered.

Failures never hang:
  * a rank that raises makes `launch` raise `RankError` with that rank's traceback;
  * a rank that dies (killed, segfault, os._exit) is reported with its exit code and the
    operation it was in (minitron.comm publishes that to the parent);
  * a collective that a peer never joins times out after `timeout` seconds inside the rank
    and comes back as the first case, naming rank and operation (gloo raises; nccl's
    watchdog aborts the rank instead, which comes back as the second case).
"""
from __future__ import annotations

import atexit
import datetime
import io
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import socket
import sys
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import comm

DEFAULT_TIMEOUT = float(os.environ.get("MINITRON_TIMEOUT", "120"))
_STATUS_LEN = 200
_in_worker = False


class RankError(RuntimeError):
    """A rank raised, died, or did not finish."""


def launch(fn: Callable, *args, world_size: int, backend: str | None = None,
           timeout: float = DEFAULT_TIMEOUT, echo: bool = True, **kwargs) -> list[Any]:
    if _in_worker:
        raise RuntimeError("launch() was called inside a launched rank: call fn directly there")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if _under_torchrun():
        return _launch_under_torchrun(fn, args, kwargs, world_size, backend, timeout)
    backend = backend or _pick_backend(world_size)
    _check_can_fork(backend)
    ranks = [_Rank(r, world_size) for r in range(world_size)]
    port = _free_port()
    try:  # a failed start, or Ctrl-C in a notebook, must not leave the started ranks behind
        for r in ranks:
            r.start(_child_main, (r.rank, world_size, port, backend, timeout, fn, args, kwargs))
        return _collect(ranks, echo, timeout)
    finally:
        for r in ranks:
            r.kill()


# ----------------------------------------------------------------------------------------
# One forked rank: a process, a pipe for its result, a shared string for what it is doing
# ----------------------------------------------------------------------------------------
class _Rank:
    ctx = mp.get_context("fork")

    def __init__(self, rank: int, world_size: int):
        self.rank = rank
        self.status = self.ctx.Array("c", _STATUS_LEN, lock=False)
        self.parent_conn, self.child_conn = self.ctx.Pipe(duplex=True)

    def start(self, target, args):
        self.process = self.ctx.Process(
            target=target, args=(*args, self.child_conn, self.status, os.getpid()), daemon=True)
        self.process.start()
        self.child_conn.close()

    def doing(self) -> str:
        return self.status.value.decode(errors="replace") or "starting up"

    def kill(self):
        p = getattr(self, "process", None)
        if p is not None and p.is_alive():
            p.kill()
            p.join(5)


def _enter_rank(rank: int, world_size: int, port: int, status, parent_pid: int):
    """What every forked rank does first; returns the function that publishes what it is doing."""
    # A forked child whose parent already used torch's thread pool deadlocks at its first
    # matmul unless it resets the pool first; one thread per rank also suits small CPUs.
    torch.set_num_threads(1)
    global _in_worker
    _in_worker = True
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    # Die with the parent, even when it is SIGKILLed (a crashed notebook kernel, a killed
    # pytest): each rank inherited a copy of its own pipe's parent end, so it would never see
    # that pipe close and would wait on it forever. Linux only (prctl PR_SET_PDEATHSIG = 1).
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)

    def publish(what: str):
        status.value = what.encode()[:_STATUS_LEN - 1]

    comm.set_status_hook(publish)
    publish("init_process_group")
    return publish


def _child_main(rank, world_size, port, backend, timeout, fn, args, kwargs, conn, status,
                parent_pid):
    publish = _enter_rank(rank, world_size, port, status, parent_pid)
    out, err = io.StringIO(), io.StringIO()
    sys.stdout, sys.stderr = out, err
    native = _capture_native_output()  # C++ logs (gloo, NCCL) bypass sys.stdout/stderr
    try:
        _init(backend, rank, world_size, timeout)
        publish("running")
        payload = ("ok", fn(*args, **kwargs))
    except BaseException:
        payload = ("error", traceback.format_exc())
    err.write(native())
    try:
        data = dumps_for_parent((*payload, out.getvalue(), err.getvalue()))
    except Exception as e:
        data = pickle.dumps(("error", f"rank {rank}'s result cannot be pickled: {e}",
                             out.getvalue(), err.getvalue()))
    conn.send_bytes(data)
    try:
        conn.recv_bytes()  # the parent says when everyone is done; then tear down together
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:
        pass
    os._exit(0)  # never run the parent's atexit handlers (a Jupyter kernel's, say)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


class _CPUPickler(pickle.Pickler):
    """Results travel to the parent as CPU tensors: unpickling a CUDA tensor there would
    initialise CUDA in the parent, and after that no rank can be forked with a GPU."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
            return _same, (obj.detach().cpu(),)
        return NotImplemented


def dumps_for_parent(obj: Any) -> bytes:
    buffer = io.BytesIO()
    _CPUPickler(buffer).dump(obj)
    return buffer.getvalue()


def _capture_native_output() -> Callable[[], str]:
    """Point file descriptors 1 and 2 at a temporary file; return a reader for it.

    In a notebook, ipykernel forwards these descriptors into the cell's output, where text
    from several ranks would interleave at random and break nbval's comparison."""
    import tempfile
    tmp = tempfile.TemporaryFile(mode="w+b")
    for fd in (1, 2):
        try:
            os.dup2(tmp.fileno(), fd)
        except OSError:
            pass

    def read() -> str:
        tmp.seek(0)
        return tmp.read().decode(errors="replace")
    return read


def _collect(ranks: list[_Rank], echo: bool, timeout: float) -> list[Any]:
    pending = {r.parent_conn: r for r in ranks}
    sentinels = {r.process.sentinel: r for r in ranks}
    replies: dict[int, tuple] = {}
    while pending:
        # Once one rank has finished, the others get `timeout` more seconds (a backstop:
        # a stuck collective normally times out inside the rank first and reports itself).
        ready = mp.connection.wait([*pending, *sentinels], timeout=timeout + 30 if replies else None)
        if not ready:
            stuck = "\n".join(f"  rank {r.rank}: {r.doing()}" for r in pending.values())
            raise RankError(f"ranks {sorted(replies)} finished but these did not within "
                            f"{timeout + 30:.0f} s:\n{stuck}")
        for obj in ready:
            if obj in pending:
                r = pending.pop(obj)
                try:
                    replies[r.rank] = pickle.loads(obj.recv_bytes())
                except EOFError:  # died before replying
                    r.process.join()
                    _echo(replies, echo)
                    raise RankError(f"rank {r.rank} died with {_exit_reason(r.process.exitcode)} "
                                    f"while in: {r.doing()}") from None
                sentinels.pop(r.process.sentinel, None)
                if replies[r.rank][0] == "error":
                    _echo(replies, echo)
                    _raise_if_a_peer_died(ranks, replies)  # then that death is the root cause
                    others = [f"  rank {o.rank}: {o.doing()}" for o in ranks
                              if o.rank not in replies]
                    waiting = ("\nThe other ranks were stopped while doing:\n" + "\n".join(others)
                               if others else "")
                    raise RankError(f"rank {r.rank} raised:\n{replies[r.rank][1]}{waiting}")
            elif obj in sentinels:
                r = sentinels.pop(obj)
                if r.parent_conn in pending and not r.parent_conn.poll():
                    r.process.join()
                    _echo(replies, echo)
                    raise RankError(f"rank {r.rank} died with {_exit_reason(r.process.exitcode)} "
                                    f"while in: {r.doing()}")
    for r in ranks:
        try:
            r.parent_conn.send_bytes(b"done")
        except OSError:
            pass
    for r in ranks:
        r.process.join(10)
    _echo(replies, echo)
    return [replies[r.rank][1] for r in ranks]


def _raise_if_a_peer_died(ranks: list[_Rank], replies: dict[int, tuple]) -> None:
    """When a peer dies, the survivors' collectives fail too ("connection reset by peer"),
    sometimes before the parent has seen the death: look for it briefly before blaming them."""
    alive = [o for o in ranks if o.rank not in replies]
    if alive:
        mp.connection.wait([o.process.sentinel for o in alive], timeout=0.5)
    for o in alive:
        if o.process.exitcode is not None:
            raise RankError(f"rank {o.rank} died with {_exit_reason(o.process.exitcode)} "
                            f"while in: {o.doing()}")


def _echo(replies: dict[int, tuple], echo: bool) -> None:
    if not echo:
        return
    for rank in sorted(replies):
        _, _, out, err = replies[rank]
        for text, stream in ((out, sys.stdout), (err, sys.stderr)):
            for line in text.splitlines():
                print(f"[rank {rank}] {line}", file=stream)


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"exit code {code}"


# ----------------------------------------------------------------------------------------
# Process groups
# ----------------------------------------------------------------------------------------
def _pick_backend(world_size: int) -> str:
    """MINITRON_BACKEND if set (the lessons set gloo: their numbers are CPU numbers), else
    nccl when there is one GPU per rank, else gloo."""
    chosen = os.environ.get("MINITRON_BACKEND")
    if chosen:
        if chosen not in ("gloo", "nccl"):
            raise ValueError(f"MINITRON_BACKEND={chosen!r}: use 'gloo' or 'nccl'")
        return chosen
    # device_count() asks NVML; torch.cuda.is_available() would initialise the CUDA driver in
    # this process, and a rank forked after that cannot use CUDA ("poison fork").
    if torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def _check_can_fork(backend: str) -> None:
    """Ranks on GPUs need a parent that has not initialised CUDA (gloo ranks do not care)."""
    if backend == "nccl" and torch.cuda.is_initialized():
        raise RuntimeError("CUDA was initialised in this process before launch(); a forked "
                           "rank cannot inherit it. Do all CUDA work inside the launched "
                           "function, pass backend='gloo', or run the script under torchrun.")


def _init(backend: str, rank: int, world_size: int, timeout: float) -> None:
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    comm.TIMEOUT = datetime.timedelta(seconds=timeout)  # every later group gets it too
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=comm.TIMEOUT)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _launch_under_torchrun(fn, args, kwargs, world_size, backend, timeout):
    world = int(os.environ["WORLD_SIZE"])
    if world != world_size:
        raise ValueError(f"torchrun started {world} processes but launch() asked for "
                         f"world_size={world_size}: make them agree (torchrun --nproc-per-node ...)")
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        _init(backend, int(os.environ["RANK"]), world, timeout)
        # A group still alive when the interpreter exits can abort the process ("terminate
        # called without an active exception", about one run in three with gloo): tear it down.
        atexit.register(_destroy_at_exit)
    result = fn(*args, **kwargs)
    results: list[Any] = [None] * world
    dist.all_gather_object(results, result)
    return results


def _destroy_at_exit() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
