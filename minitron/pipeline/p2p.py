"""Activations forward and gradients backward between neighbouring pipeline stages.

Every message between stages is one activation-sized tensor whose shape both ends know ahead:
[micro-batch, seq, hidden], or [micro-batch, seq/tp, hidden] under sequence parallelism (only
this tp rank's part of the sequence travels; without SP every tp rank sends its own copy of
the replicated activation to the same tp rank of the next stage, as Megatron does). So no
shapes are exchanged first: the receiver allocates the buffer and posts the receive.

A run of consecutive message actions (pipeline/actions.py) is posted as one batch through
comm.exchange (batch_isend_irecv, counted), so two neighbours that send to each other at the
same time (1F1B's send_forward_recv_backward) do not deadlock. Within a batch the messages to
and from one peer are posted in an order both ends derive from the message itself (direction,
micro-batch, the sending stage), because gloo and NCCL match messages between two ranks in the
order they were posted, not by content.
"""
from __future__ import annotations

import torch

from .. import comm
from ..grid import Grid
from ..model.config import ModelConfig
from .actions import RECV_B, RECV_F, SEND_B, SEND_F, Action


def message_shape(cfg: ModelConfig, grid: Grid, microbatch_size: int, seq: int) -> tuple[int, int, int]:
    """The shape of every activation or gradient sent between stages."""
    if grid.sequence_parallel:
        return (microbatch_size, seq // grid.tp.size, cfg.hidden)
    return (microbatch_size, seq, cfg.hidden)


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


def exchange(batch: list[Action], outgoing: dict[Action, torch.Tensor], shape: tuple[int, ...],
             dtype: torch.dtype, device: torch.device, group: comm.Group) -> dict[Action, torch.Tensor]:
    """Post one batch of message actions; returns the received tensors by their RECV action.

    `outgoing` holds the tensor of every SEND action in the batch."""
    ops, received = [], {}
    for action in sorted(batch, key=message_key):
        if action.kind in (SEND_F, SEND_B):
            t = outgoing[action]
            if tuple(t.shape) != tuple(shape):
                raise ValueError(f"{action}: the tensor to send is {tuple(t.shape)}, but every "
                                 f"stage-to-stage message is {tuple(shape)}")
            ops.append(comm.P2P("send", t.detach().contiguous(), action.peer))
        else:
            received[action] = torch.empty(shape, dtype=dtype, device=device)
            ops.append(comm.P2P("recv", received[action], action.peer))
    comm.exchange(ops, group)
    return received
