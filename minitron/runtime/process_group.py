"""Process groups: which backend a run gets, how a rank joins it, and the run under torchrun.

launch.py forks ranks on one machine and calls init_process_group in each; under torchrun
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set) the processes already exist, and
launch_under_torchrun runs the function on this one, gathers every rank's result and prints as a
forked launch does: once.

Forked ranks meet at a store their parent serves (rendezvous_store): the parent binds port 0, so
the OS picks the port as it binds it and no other process can take it in between, as it could
take a port that was found free, closed, and handed on for rank 0 to bind a moment later. gloo's
own connections need nothing: each rank listens on a port its bind picks, and publishes it in
the store.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import io
import os
import pickle
import socket
import sys
from typing import Any

import torch
import torch.distributed as dist

from . import comm
from .rank_output import dumps_for_parent


def pick_backend(ranks_here: int) -> str:
    """MINITRON_BACKEND if set (the lessons set gloo: their numbers are CPU numbers), else
    nccl when this machine has one GPU for each of its `ranks_here` ranks, else gloo. The one
    decision, for forked ranks (ranks_here = world size) and torchrun's (LOCAL_WORLD_SIZE)."""
    chosen = os.environ.get("MINITRON_BACKEND")
    if chosen:
        if chosen not in ("gloo", "nccl"):
            raise ValueError(f"MINITRON_BACKEND={chosen!r}: use 'gloo' or 'nccl'")
        return chosen
    # device_count() asks NVML; torch.cuda.is_available() would initialise the CUDA driver in
    # this process, and a rank forked after that cannot use CUDA ("poison fork").
    if torch.cuda.device_count() >= ranks_here:
        return "nccl"
    return "gloo"


def ranks_on_this_machine(world_size: int) -> int:
    """Under torchrun, the ranks of this node (LOCAL_WORLD_SIZE); forked ranks all share it."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if under_torchrun() else world_size


def rank_device(backend: str, local_rank: int) -> torch.device:
    """One process per GPU under nccl: local rank k owns cuda:k; gloo ranks compute on the CPU."""
    return torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")


def group_options(backend: str, local_rank: int) -> dict:
    """init_process_group's extra arguments. Under nccl, device_id makes every communicator
    now (ncclCommInit, then ncclCommSplit for each new_group) instead of at its first use: a
    first batch_isend_irecv in a group must otherwise involve all of its ranks, which a
    pipeline stage's send to its neighbour does not. gloo needs nothing."""
    return {"device_id": rank_device(backend, local_rank)} if backend == "nccl" else {}


def check_can_fork(backend: str) -> None:
    """Ranks on GPUs need a parent that has not initialised CUDA (gloo ranks do not care)."""
    if backend == "nccl" and torch.cuda.is_initialized():
        raise RuntimeError("CUDA was initialised in this process before launch(); a forked "
                           "rank cannot inherit it. Do all CUDA work inside the launched "
                           "function, pass backend='gloo', or run the script under torchrun.")


def rendezvous_store(timeout: float) -> dist.TCPStore:
    """A store served by this process on a port chosen by its own bind (port 0), for ranks to
    meet at: forked ranks (launch, WorkerPool) join it as clients (init_process_group's `port`),
    and torchrun agents standing for nodes on this machine do too (`--rdzv-endpoint
    127.0.0.1:PORT --rdzv-conf is_host=false`). It must outlive them: every later new_group
    meets there as well. It stops when the object is dropped.

    The listening socket is made here, with a backlog of 128 connections, and handed to the
    store. Left to itself c10d listens with a backlog of -1 ("the system's maximum"), which
    some network stacks take as the smallest: in the sandbox CI runs in, the 6th of 8 ranks
    connecting at once had its connection dropped, and c10d tried again 5 s later: in 2 to 6 of
    12 8-rank launches from a script (tests/test_launch.py: test_eight_ranks_meet_...)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        port = sock.getsockname()[1]
        store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout),
                              master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()                          # the store owns the descriptor now, and closes it
    return store


def init_process_group(backend: str, rank: int, world_size: int, timeout: float,
                       port: int | None = None) -> None:
    """Join the group: at the parent's rendezvous_store on `port` (forked ranks), else where
    the environment says (torchrun's MASTER_ADDR and MASTER_PORT)."""
    options = {}
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"local rank {local_rank} has no GPU of its own: this machine has "
                               f"{torch.cuda.device_count()}; start at most that many ranks per "
                               "node (torchrun --nproc-per-node), or use MINITRON_BACKEND=gloo")
        torch.cuda.set_device(rank_device(backend, local_rank))
        options = group_options(backend, local_rank)
    comm.TIMEOUT = datetime.timedelta(seconds=timeout)  # every later group gets it too
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if port is not None:
        options["store"] = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=comm.TIMEOUT)
    elif under_torchrun() and attempt not in ("", "0"):
        # torchrun restarted the group: its store still holds the dead attempt's addresses
        # under the same keys, and gloo would connect to those; this attempt's keys are its own
        store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=comm.TIMEOUT))
        options["store"] = dist.PrefixStore(f"attempt{attempt}/", store)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=comm.TIMEOUT,
                            **options)


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))



def end_of_run() -> None:
    """Under torchrun, the last call of a script's every process (no-op otherwise): wait until
    every rank has got here (rank 0 has written its summary and files), then tear the group
    down. A process that then aborts while the interpreter exits ("terminate called without an
    active exception", a gloo thread) makes torchrun kill the others, rank 0 mid-write; so
    after this call the script should leave with os._exit, skipping that teardown."""
    if under_torchrun() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def launch_under_torchrun(fn, args, kwargs, world_size, backend, timeout, echo=True):
    """fn on this process; every rank's result, gathered, tensors moved to the CPU. The output
    is a forked launch's: each rank's prints during fn are echoed once, by rank 0, in rank order
    ("[rank r] ..."), and what the script prints after launch (its results) comes from rank 0
    alone: the other ranks' sys.stdout goes to /dev/null (their stderr stays)."""
    world = int(os.environ["WORLD_SIZE"])
    if world != world_size:
        raise ValueError(f"torchrun started {world} processes but launch() asked for "
                         f"world_size={world_size}: make them agree (torchrun --nproc-per-node ...)")
    if not dist.is_initialized():
        backend = backend or pick_backend(ranks_on_this_machine(world))
        init_process_group(backend, int(os.environ["RANK"]), world, timeout)
        # A group still alive when the interpreter exits can abort the process ("terminate
        # called without an active exception", about one run in three with gloo): tear it down.
        atexit.register(_destroy_at_exit)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        result = fn(*args, **kwargs)
    replies: list[Any] = [None] * world
    dist.all_gather_object(replies, dumps_for_parent((result, printed.getvalue())))
    replies = [pickle.loads(r) for r in replies]
    if dist.get_rank() == 0:
        for rank, (_, text) in enumerate(replies):
            for line in text.splitlines() if echo else ():
                print(f"[rank {rank}] {line}")
    elif sys.stdout is not _QUIET[0]:
        sys.stdout.flush()
        _QUIET[0] = sys.stdout = open(os.devnull, "w")
    return [r for r, _ in replies]


_QUIET = [None]   # the /dev/null stdout of a rank other than 0, once set


def _destroy_at_exit() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
