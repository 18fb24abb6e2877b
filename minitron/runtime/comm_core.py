"""What every message shares, collective or point-to-point: the group it travels in, and the
one wrapper around each torch.distributed call.

`_count` adds an operation's calls and bytes to every active `CommCounter` (counting.py), the
one place bytes are counted; `_call` tells the launcher which operation this rank is in (so a
hang is reported by name) and turns a failure into a `CommError` naming the rank, the operation
and the group. comm.py (collectives), comm_p2p.py (send, recv, exchange) and comm_async.py
(started now, waited for later) are built on these; `minitron.runtime.comm` re-exports them.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from .counting import _active


class CommError(RuntimeError):
    """A collective or point-to-point operation failed (timeout, dead peer, mismatch)."""


class Group:
    """A process group together with the global ranks it contains, in order."""

    def __init__(self, name: str, ranks: Sequence[int], pg=None):
        self.name = name
        self.ranks = tuple(int(r) for r in ranks)
        self.pg = pg  # the torch ProcessGroup; None when size == 1

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        """This process's index inside the group."""
        me = dist.get_rank() if dist.is_initialized() else 0
        if me not in self.ranks:
            raise ValueError(f"rank {me} is not in group {self.name!r} {list(self.ranks)}: "
                             "only its members may ask for their place in it")
        return self.ranks.index(me)

    def global_rank(self, group_rank: int) -> int:
        return self.ranks[group_rank]

    def __repr__(self) -> str:
        return f"Group({self.name!r}, ranks={list(self.ranks)})"


def single_group(name: str = "self") -> Group:
    """A group of one process: every operation on it is free."""
    me = dist.get_rank() if dist.is_initialized() else 0
    return Group(name, [me])


def _count(group: Group, op: str, payload: int, wire: float) -> None:
    for counter in _active:
        counter.add(group.name, op, payload, wire)


# The launcher installs a hook that publishes "rank r is in <op> on <group>" to the parent.
_status_hook: Callable[[str], None] | None = None


def set_status_hook(hook: Callable[[str], None] | None) -> None:
    global _status_hook
    _status_hook = hook


def _call(op: str, group: Group, fn: Callable):
    what = f"{op} on group '{group.name}' {list(group.ranks)}"
    if _status_hook is not None:
        _status_hook(what)
    try:
        return fn()
    except Exception as e:  # gloo/nccl errors are terse: say who and what
        me = dist.get_rank() if dist.is_initialized() else 0
        raise CommError(f"rank {me}: {what} failed: {e}") from e
    finally:
        if _status_hook is not None:
            _status_hook(f"running (last: {what})")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _in_place(t: torch.Tensor, fn: Callable[[torch.Tensor], object]) -> torch.Tensor:
    """Run an in-place operation on a contiguous buffer (nccl refuses strided tensors, gloo
    refuses them for recv), then write the result back into `t`."""
    buf = t if t.is_contiguous() else t.contiguous()
    fn(buf)
    if buf is not t:
        t.copy_(buf)
    return t
