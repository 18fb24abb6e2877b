"""Pipeline schedules as data: what each pipeline rank does, in order.

A schedule is a pure function (pp, microbatches, virtual) -> Schedule. The executor, the
checker, the simulator and the plots all read the same Schedule; nothing else decides order.

Stages. The model's layers are cut into pp * virtual equal chunks, numbered 0.. in model order
(the embedding lives in stage 0, the final norm, output layer and loss in the last). Each
chunk is a *stage* and lives on one pipeline rank, given by Schedule.stage_rank:
  plain and interleaved (Megatron)  stage s on rank s % pp          (rank r holds r, r+pp, ...)
  V-shaped (ZB-V, DualPipeV)        stage s on rank s for s < pp, 2*pp-1-s after (rank r: r, 2pp-1-r)

Actions. Compute actions name a micro-batch and a stage:
  F   forward of that stage (the last stage's F includes the loss)
  B   backward for the stage's *input* only (dL/dX); the weight gradients are deferred
  W   the deferred weight gradients of that (micro-batch, stage)
  BW  a full backward: B and W at once (GPipe, 1F1B, interleaved 1F1B)
An F directly followed by a BW of another micro-batch may be marked *overlapped*
(Schedule.overlapped, DualPipeV): one unit of work whose two halves hide each other's
communication: the executor runs the halves as two threads taking turns (pairs.py), one
computing while the other's MoE all-to-all is in flight. Their two Events overlap in time, so a
Timeline's busy time counts that span twice.
Messages between ranks are actions too; `stage` is the stage *on this rank* that produces
or consumes the tensor, `peer` the pipeline rank at the other end:
  SEND_F  stage s's output, to the rank of stage s+1       RECV_F  stage s's input, from s-1's rank
  SEND_B  dL/d(input of s), to the rank of stage s-1       RECV_B  dL/d(output of s), from s+1's rank
Where two neighbouring stages are on the same rank (the turn of ZB-V's V), nothing is sent: the
tensor is handed over in memory. Consecutive message actions in a rank's list are posted
together as one batch (torch.distributed.batch_isend_irecv, like Megatron's
send_forward_recv_backward), so neighbours that exchange in both directions do not deadlock.
"""
from __future__ import annotations

import dataclasses

F, B, W, BW = "F", "B", "W", "BW"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMPUTE = (F, B, W, BW)
MESSAGES = (SEND_F, RECV_F, SEND_B, RECV_B)


@dataclasses.dataclass(frozen=True)
class Action:
    kind: str                 # one of COMPUTE or MESSAGES
    microbatch: int
    stage: int                # global stage (model chunk) index, 0 .. pp*virtual-1
    peer: int | None = None   # messages only: the pipeline rank at the other end

    def __post_init__(self):
        if self.kind not in COMPUTE + MESSAGES:
            raise ValueError(f"action kind must be one of {COMPUTE + MESSAGES}, got {self.kind!r}")
        if (self.peer is None) != (self.kind in COMPUTE):
            raise ValueError(f"{self.kind}: a message needs a peer rank, a compute action has none")

    @property
    def is_message(self) -> bool:
        return self.kind in MESSAGES

    def __str__(self) -> str:   # F3@s1, SEND_F3@s1->2
        text = f"{self.kind}{self.microbatch}@s{self.stage}"
        if self.peer is not None:
            text += f"{'->' if self.kind.startswith('SEND') else '<-'}{self.peer}"
        return text


@dataclasses.dataclass(frozen=True)
class Schedule:
    name: str
    pp: int
    microbatches: int
    virtual: int                          # stages (model chunks) per rank
    stage_rank: tuple[int, ...]           # stage -> pipeline rank, len pp * virtual
    actions: dict[int, tuple[Action, ...]]   # pipeline rank -> its actions, in order
    # pipeline rank -> (F, BW) pairs of two micro-batches that a GPU runs as one, each one's
    # compute hiding the other's communication (DualPipeV); adjacent in the rank's list
    overlapped: dict[int, tuple[tuple[Action, Action], ...]] = dataclasses.field(default_factory=dict)

    @property
    def n_stages(self) -> int:
        return self.pp * self.virtual

    def stages_of(self, rank: int) -> list[int]:
        """The stages pipeline rank `rank` holds, in model order."""
        return [s for s, r in enumerate(self.stage_rank) if r == rank]

    def compute(self, rank: int) -> list[Action]:
        return [a for a in self.actions[rank] if not a.is_message]


def interleaved_placement(pp: int, virtual: int) -> tuple[int, ...]:
    """Megatron's: stage s on rank s % pp (virtual == 1 is the plain pipeline)."""
    return tuple(s % pp for s in range(pp * virtual))


def v_placement(pp: int) -> tuple[int, ...]:
    """ZB-V's: two stages per rank, down the ranks then back up (rank 0 holds the first and last)."""
    return tuple(range(pp)) + tuple(reversed(range(pp)))


@dataclasses.dataclass(frozen=True)
class Event:
    """One compute action as it ran (measured) or would run (simulated); times in any unit."""
    rank: int
    kind: str
    microbatch: int
    stage: int
    start: float
    end: float


@dataclasses.dataclass
class Timeline:
    """Every rank's compute events: a simulated or a measured run, in the same form.

    bubble_fraction = idle rank-time / total rank-time over [first start, last end]
    (GPipe and 1F1B at equal F/B cost: (p-1)/(m+p-1)); bubble_ratio = idle / busy, the
    bubble in units of the ideal (no-bubble) time ((p-1)/m for the same).
    """
    name: str
    pp: int
    events: list[Event]

    @property
    def makespan(self) -> float:
        return max(e.end for e in self.events) - min(e.start for e in self.events)

    def busy(self, rank: int | None = None) -> float:
        return sum(e.end - e.start for e in self.events if rank is None or e.rank == rank)

    @property
    def bubble_fraction(self) -> float:
        total = self.pp * self.makespan
        return (total - self.busy()) / total

    @property
    def bubble_ratio(self) -> float:
        return (self.pp * self.makespan - self.busy()) / self.busy()


def check_args(name: str, pp: int, microbatches: int, virtual: int, allowed: tuple[int, ...]):
    """A schedule's arguments, refused before it is built: pp and microbatches >= 1, virtual
    one of `allowed`."""
    if pp < 1 or microbatches < 1:
        raise ValueError(f"{name}: pp and microbatches must be >= 1, got pp={pp}, "
                         f"microbatches={microbatches}")
    if virtual not in allowed:
        hint = " (choose 'interleaved' for more chunks per rank)" if allowed == (1,) else ""
        raise ValueError(f"{name}: virtual={virtual} is not supported; use virtual in "
                         f"{allowed}{hint}")


def last_backward_tail(actions: list[Action], microbatches: int) -> int | None:
    """Where the rank's last backward work starts: the index of the first action after which
    every backward action (BW, B, W) is of the last micro-batch; None if the rank has none.
    From there each parameter receives exactly one more gradient, so a data-parallel engine can
    count it as ready and start its bucket while the rest of the backward runs. Not with a
    B/W split (zero-bubble schedules): a weight's gradient lands in its deferred W, outside the
    autograd hooks that count readiness, so those runs reduce everything after the schedule."""
    if any(a.kind == W for a in actions):
        return None
    last = microbatches - 1
    backward = [i for i, a in enumerate(actions) if a.kind in (BW, B, W)]
    earlier = [i for i in backward if actions[i].microbatch != last]
    tail = [i for i in backward if actions[i].microbatch == last and (not earlier or i > earlier[-1])]
    return tail[0] if tail else None
