"""One forked rank, from the parent's side and the child's: what launch and WorkerPool share.

    _Rank         a process, a pipe for its result, shared memory for what it is doing and how
                  far it got (deadline.py reads it), and (launch's ranks) a file for its stderr
    _meet_at      tell the ranks the port of the store they meet at, started after the forks
    _enter_rank   what every forked rank does first: one thread, die with the parent, join
"""
from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal

import torch

from . import comm
from .rank_output import append_only_file, read_log

_STATUS_LEN = 200
_in_worker = False     # set in a forked rank: launch() refuses to nest (launch.py)


class _Rank:
    ctx = mp.get_context("fork")

    def __init__(self, rank: int, world_size: int, log: bool = False):
        self.rank = rank
        self.status = self.ctx.Array("c", _STATUS_LEN, lock=False)
        # [status changes, CPU seconds, time of the last heartbeat] (deadline.py)
        self.progress = self.ctx.Array("d", 3, lock=False)
        self.parent_conn, self.child_conn = self.ctx.Pipe(duplex=True)
        self.log_fd = append_only_file() if log else None

    def start(self, target, args):
        self.process = self.ctx.Process(
            target=target, daemon=True,
            args=(*args, self.child_conn, self.status, self.progress, self.log_fd, os.getpid()))
        self.process.start()
        self.child_conn.close()

    def tell_port(self, port: int):
        try:
            self.parent_conn.send_bytes(str(port).encode())
        except OSError:  # it died already: its sentinel says so, with its exit code
            pass

    def doing(self) -> str:
        return self.status.value.decode(errors="replace") or "starting up"

    def log(self) -> str:
        return "" if self.log_fd is None else read_log(self.log_fd)

    def kill(self):
        p = getattr(self, "process", None)
        if p is not None and p.is_alive():
            p.kill()
            p.join(5)
        if self.log_fd is not None:
            os.close(self.log_fd)
            self.log_fd = None


def _meet_at(store, ranks: list[_Rank]):
    """Tell the forked ranks the port of the store they meet at, which is started only after
    the forks: a rank forked while the store's server thread ran could inherit a lock that
    thread held. Returns the store, for the caller to keep until the ranks are done."""
    for r in ranks:
        r.tell_port(store.port)
    return store


def _enter_rank(rank: int, world_size: int, conn, status, progress, parent_pid: int) -> tuple:
    """What every forked rank does first; returns the port of the store the ranks meet at
    (the parent's first message) and the function that publishes what the rank is doing."""
    # A forked child whose parent already used torch's thread pool deadlocks at its first
    # matmul unless it resets the pool to one thread (with 2 threads, or untouched, it hangs:
    # OpenMP is not fork-safe). GPU ranks too: their CPU work (batches, init) is small. Under
    # torchrun nothing is forked and torchrun's OMP_NUM_THREADS decides.
    torch.set_num_threads(1)
    # The objects inherited from the parent (torch's modules, a notebook's state) are never this
    # rank's garbage: frozen, the collector stops walking them, and stops writing into their
    # pages, each write a copy of a page the rank shares with its parent (gc.freeze's purpose).
    gc.freeze()
    global _in_worker
    _in_worker = True
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
    port = int(conn.recv_bytes())   # the parent's first message (it kills us if it fails first)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))

    def publish(what: str):
        status.value = what.encode()[:_STATUS_LEN - 1]
        progress[0] += 1

    comm.set_status_hook(publish)
    publish("init_process_group")
    return port, publish
