"""Process groups: which backend a run gets, how a rank joins it, and the run under torchrun.

launch.py forks ranks on one machine and calls init_process_group in each; under torchrun
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set) the processes already exist, and
launch_under_torchrun runs the function on this one and gathers every rank's result.
"""
from __future__ import annotations

import atexit
import datetime
import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from . import comm


def pick_backend(world_size: int) -> str:
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


def check_can_fork(backend: str) -> None:
    """Ranks on GPUs need a parent that has not initialised CUDA (gloo ranks do not care)."""
    if backend == "nccl" and torch.cuda.is_initialized():
        raise RuntimeError("CUDA was initialised in this process before launch(); a forked "
                           "rank cannot inherit it. Do all CUDA work inside the launched "
                           "function, pass backend='gloo', or run the script under torchrun.")


def init_process_group(backend: str, rank: int, world_size: int, timeout: float) -> None:
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    comm.TIMEOUT = datetime.timedelta(seconds=timeout)  # every later group gets it too
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if under_torchrun() and attempt not in ("", "0"):
        # torchrun restarted the group: its store still holds the dead attempt's addresses
        # under the same keys, and gloo would connect to those; this attempt's keys are its own
        store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=comm.TIMEOUT))
        dist.init_process_group(backend, store=dist.PrefixStore(f"attempt{attempt}/", store),
                                rank=rank, world_size=world_size, timeout=comm.TIMEOUT)
        return
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=comm.TIMEOUT)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def launch_under_torchrun(fn, args, kwargs, world_size, backend, timeout):
    world = int(os.environ["WORLD_SIZE"])
    if world != world_size:
        raise ValueError(f"torchrun started {world} processes but launch() asked for "
                         f"world_size={world_size}: make them agree (torchrun --nproc-per-node ...)")
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        init_process_group(backend, int(os.environ["RANK"]), world, timeout)
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
