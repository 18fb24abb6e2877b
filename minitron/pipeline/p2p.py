"""Activations forward and gradients backward between neighbouring pipeline stages.

Every message between stages is one activation-sized tensor whose shape both ends know ahead:
[micro-batch, seq, hidden], or [micro-batch, seq/tp, hidden] under sequence parallelism (only
this tp rank's part of the sequence travels; without SP every tp rank sends its own copy of
the replicated activation to the same tp rank of the next stage, as Megatron does). Under
context parallelism a rank holds seq/cp tokens of every sequence (its zigzag chunks), and
sends them to the rank with the same (tp, cp, dp) coordinates on the next stage: the pp group
(minitron/grid/) varies pp only. So no shapes are exchanged first: the receiver allocates the buffer
and posts the receive.

A run of consecutive message actions (pipeline/actions.py) is posted as one batch through
comm_async.exchange (batch_isend_irecv, counted), so two neighbours that send to each other at
the same time (1F1B's send_forward_recv_backward) do not deadlock. Only the receives are waited
for at once; the sends are waited for at the end of the step (exchange below says why). Messages are posted in the
schedule's order. NCCL and gloo match the messages from one rank to another in the order they
were posted, not by content, so `check_message_order` refuses, before anything runs, a schedule
whose receiver lists a sender's messages in another order than the sender (the tensors would
arrive swapped: same shapes, so nothing else would notice).
"""
from __future__ import annotations

import torch

from ..runtime import comm, comm_async
from ..grid import Grid
from ..config import ModelConfig
from .actions import RECV_B, RECV_F, SEND_B, SEND_F, Action, Schedule


def message_shape(cfg: ModelConfig, grid: Grid, microbatch_size: int, seq: int) -> tuple[int, int, int]:
    """The shape of every activation or gradient sent between stages; `seq` is the whole
    sequence's length: a rank holds seq/cp of it, and under SP 1/tp of those."""
    local = seq // grid.cp.size
    if grid.sequence_parallel:
        return (microbatch_size, local // grid.tp.size, cfg.hidden)
    return (microbatch_size, local, cfg.hidden)


def message_key(action: Action) -> tuple[str, int, int]:
    """(direction, micro-batch, sending stage): the same for a send and the receive it meets."""
    if action.kind == SEND_F:
        return ("F", action.microbatch, action.stage)
    if action.kind == RECV_F:
        return ("F", action.microbatch, action.stage - 1)
    if action.kind == SEND_B:
        return ("B", action.microbatch, action.stage)
    if action.kind == RECV_B:
        return ("B", action.microbatch, action.stage + 1)
    raise ValueError(f"{action} is not a message")


def check_message_order(schedule: Schedule) -> None:
    """ValueError unless, for every pair of ranks, the receiver's RECVs from the sender come in
    the order of the sender's SENDs to it (posting order is what the backends match by)."""
    sent: dict[tuple[int, int], list] = {}
    received: dict[tuple[int, int], list] = {}
    for rank, actions in schedule.actions.items():
        for a in actions:
            if a.kind in (SEND_F, SEND_B):
                sent.setdefault((rank, a.peer), []).append(message_key(a))
            elif a.kind in (RECV_F, RECV_B):
                received.setdefault((a.peer, rank), []).append(message_key(a))
    for pair in sorted(set(sent) | set(received)):
        if sent.get(pair, []) != received.get(pair, []):
            src, dst = pair
            raise ValueError(f"schedule {schedule.name!r}: rank {dst} receives rank {src}'s messages "
                             f"in the order {received.get(pair, [])}, but rank {src} sends "
                             f"{sent.get(pair, [])}: backends match messages in posting order, so "
                             "list them in the same order on both ranks")


def exchange(batch: list[Action], outgoing: dict[Action, torch.Tensor], shape: tuple[int, ...],
             dtype: torch.dtype, device: torch.device, group: comm.Group
             ) -> tuple[dict[Action, torch.Tensor], comm_async.Pending | None]:
    """Post one batch of message actions and wait for its receives only; returns the received
    tensors by their RECV action, and the sends still in flight (None if there are none).

    `outgoing` holds the tensor of every SEND action in the batch. A send is not waited for
    here: the sender carries on computing while the bytes travel, as torch's schedules do
    (under gloo a send completes only once the receiver has posted its receive, so waiting
    would stall the sender on the receiver). The caller keeps the Pending, which holds the
    sent tensors alive, and waits for it before the step ends; nothing writes to a sent tensor."""
    sends, recvs, received = [], [], {}
    for action in batch:
        if action.kind in (SEND_F, SEND_B):
            t = outgoing[action]
            if tuple(t.shape) != tuple(shape):
                raise ValueError(f"{action}: the tensor to send is {tuple(t.shape)}, but every "
                                 f"stage-to-stage message is {tuple(shape)}")
            sends.append(comm.P2P("send", t.detach().contiguous(), action.peer))
        else:
            received[action] = torch.empty(shape, dtype=dtype, device=device)
            recvs.append(comm.P2P("recv", received[action], action.peer))
    in_flight = comm_async.exchange(sends, group) if sends else None
    if recvs:
        comm_async.exchange(recvs, group).wait()
    return received, in_flight
