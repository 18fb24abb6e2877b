"""Point-to-point messages: one rank sends, a named peer receives.

`send` and `recv` block; `exchange` posts a batch of sends and receives at once and waits for
all of them, so no order of posting can deadlock (a ring's shift, a pipeline's stage boundary).
Peers are ranks *inside the group* (0..group.size-1). A send counts its message as payload and
wire bytes, a receive as payload only (comm.py's docstring has the table), through the same
counters as the collectives. `minitron.runtime.comm` re-exports every name here.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from .comm_core import Group, _call, _count, _in_place, _nbytes


def _peer(group: Group, peer: int, what: str) -> int:
    """The global rank of group-rank `peer`, another member of `group`."""
    if not 0 <= peer < group.size or peer == group.rank:
        raise ValueError(f"{what}: peer {peer} must be another rank of group '{group.name}' "
                         f"(0..{group.size - 1}, not this rank's {group.rank})")
    return group.global_rank(peer)


def send(t: torch.Tensor, group: Group, dst: int) -> None:
    peer = _peer(group, dst, "send")
    _count(group, "send", _nbytes(t), _nbytes(t))
    _call(f"send to group rank {dst}", group,
          lambda: dist.send(t.contiguous(), dst=peer, group=group.pg))


def recv(t: torch.Tensor, group: Group, src: int) -> torch.Tensor:
    """Fill `t` in place with group-rank `src`'s message."""
    peer = _peer(group, src, "recv")
    _count(group, "recv", _nbytes(t), 0)
    _call(f"recv from group rank {src}", group,
          lambda: _in_place(t, lambda b: dist.recv(b, src=peer, group=group.pg)))
    return t


@dataclasses.dataclass
class P2P:
    """One half of a point-to-point exchange, for `exchange`."""
    kind: str             # "send" or "recv"
    tensor: torch.Tensor
    peer: int             # group rank


def exchange(ops: list[P2P], group: Group) -> None:
    """Post all sends and receives at once and wait for all (no ordering deadlocks).

    Messages to this rank itself (a ring of one rank) never leave it: the k-th such send is
    copied into the k-th such receive, and nothing is counted."""
    for op in ops:
        if op.kind not in ("send", "recv"):
            raise ValueError(f"P2P kind must be 'send' or 'recv', not {op.kind!r}")
    me = group.rank
    to_me = [op.tensor for op in ops if op.peer == me and op.kind == "send"]
    from_me = [op.tensor for op in ops if op.peer == me and op.kind == "recv"]
    if len(to_me) != len(from_me):
        raise ValueError(f"exchange: {len(to_me)} sends but {len(from_me)} receives with this "
                         "rank itself as the peer; they must pair up")
    for src, dst in zip(to_me, from_me):
        dst.copy_(src)
    ops = [op for op in ops if op.peer != me]
    if not ops:
        return
    torch_ops, strided = [], []   # strided: (caller's tensor, the contiguous buffer received into)
    for op in ops:
        _count(group, op.kind, _nbytes(op.tensor), _nbytes(op.tensor) if op.kind == "send" else 0)
        fn = dist.isend if op.kind == "send" else dist.irecv
        buf = op.tensor.contiguous()
        if op.kind == "recv" and buf is not op.tensor:
            strided.append((op.tensor, buf))
        torch_ops.append(dist.P2POp(fn, buf, _peer(group, op.peer, "exchange"), group=group.pg))
    peers = sorted({op.peer for op in ops})

    def run():
        for work in dist.batch_isend_irecv(torch_ops):
            work.wait()
        for t, buf in strided:
            t.copy_(buf)
    _call(f"exchange with group ranks {peers}", group, run)
