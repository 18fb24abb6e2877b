"""One executor for every schedule: run a Schedule's actions on the real model, on every rank.

Each pipeline rank walks its own action list (pipeline/actions.py) in order:

  F   run the stage on the micro-batch's input: tokens for stage 0, else what arrived from the
      previous stage (or was handed over in memory, when that stage is on this rank). The last
      stage adds the loss of the micro-batch, scaled by 1/microbatches, so the summed gradients
      are those of the reference's mean over the whole batch.
  BW  backward through the stage: from the loss on the last stage, else from the gradient of
      the stage's output that arrived; leaves dL/d(input) to send back.
  B   the same, but the linear layers queue their weight-gradient GEMMs (weight_grad.py)
  W   run the queued weight-gradient GEMMs of that (micro-batch, stage)
  SEND_*/RECV_*  consecutive message actions are posted together as one batch (p2p.py); its
      receives are waited for at once, its sends when the next batch is posted (or the step ends)
An overlapped (F, BW) pair (Schedule.overlapped, DualPipeV) runs as one where the stages have
an MoE all-to-all to hide: each half's all-to-alls in flight while the other computes (pairs.py).

Beside it, each importable from here: pairs.py (the pairs, hides_all_to_all), aux_loss.py (the
routers' terms of a stage not the last), outputs.py (collect_outputs), actions.last_backward_tail.

After the last action the gradient fix-ups (PipelineGPT.finalize_grads): sequence-parallel sums
over tp, the average over cp, the tied embedding over the first and last stage.

Context parallelism (grid.cp > 1): every cp rank of a stage runs the same schedule on its own
zigzag chunks of every micro-batch's sequences (context_parallel.shard_sequence), so every
message carries s/cp tokens (p2p.message_shape) between ranks of equal (tp, cp, dp) coordinates.
A rank's loss is the mean over its own tokens; the reported loss is their mean over cp.

Dropout masks are keyed by (step seed, global layer, call, global batch row) (tensor_parallel/
random.py): before each F the executor names where the micro-batch's rows start in the global
batch (`rng.rows_from`; a data-parallel replica's micro-batch is one block of rows, train/step.py
replica_rows) and the stage its global layers, so the masks are the reference's in any order
of the work.

Every compute action is timed (time.perf_counter: one clock for a machine's processes) into
actions.Event rows: a real run's actions.Timeline has the simulator's form, and its live
activation memory can be measured (memory.py); measure.py launches a schedule and gathers both.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time

import torch

from ..runtime import comm
from ..context_parallel import shard_sequence
from ..tensor_parallel import weight_grad
from .actions import (B, BW, COMPUTE, F, RECV_F, SEND_B, SEND_F, W, Action, Event, Schedule,
                      last_backward_tail)
from .aux_loss import carry_aux_loss
from .memory import ActivationMemory
from . import pairs
from .pairs import hides_all_to_all
from .p2p import check_message_order, exchange, message_shape
from .outputs import collect_outputs  # noqa: F401  (a public name of this module since it began)

# `model` below is a PipelineGPT (model/stages.py): a floor above this one, so only named here.


@dataclasses.dataclass
class StepResult:
    """What one rank saw of one step (None where its stages do not produce it)."""
    loss: torch.Tensor | None           # the batch's mean loss (the scaled micro-batches', cp's mean)
    logits: list[torch.Tensor] | None   # last stage: each micro-batch's logits shard [mb, s/cp, V/tp]
    input_grads: list[torch.Tensor] | None   # stage 0: dL/dX of each micro-batch (X: this rank's embed)
    events: list[Event]                 # this rank's compute actions, as run
    peak_bytes: int                     # activation bytes alive at the worst moment
    peak_alive: int                     # (micro-batch, stage) pairs whose activations were alive then
    unit_bytes: dict                    # (micro-batch, stage) -> bytes its forward saved


def check_schedule_fits(schedule: Schedule, model: PipelineGPT, batch: int) -> None:
    if tuple(schedule.stage_rank) != tuple(model.placement):
        raise ValueError(f"schedule {schedule.name!r} places stages on ranks {schedule.stage_rank}, "
                         f"but the model was built for {model.placement}: build PipelineGPT with "
                         "placement=schedule.stage_rank")
    if schedule.pp != model.grid.pp.size:
        raise ValueError(f"schedule {schedule.name!r} is for pp={schedule.pp}, the grid has "
                         f"pp={model.grid.pp.size}")
    if batch % schedule.microbatches:
        raise ValueError(f"a batch of {batch} cannot be cut into {schedule.microbatches} equal "
                         f"micro-batches: use a batch that is a multiple of {schedule.microbatches}")
    check_message_order(schedule)


def _first_rows(rows, batch: int, mbs: int) -> list[int]:
    """Where each micro-batch starts in the global batch, `rows` the global row of each row
    (None: the whole batch, in order). Dropout keys a micro-batch by its first row, so each
    micro-batch's rows must be consecutive rows of the batch."""
    rows = torch.arange(batch) if rows is None else torch.as_tensor(rows).cpu()
    if rows.shape != (batch,):
        raise ValueError(f"rows names {tuple(rows.shape)} rows for a batch of {batch}")
    blocks = rows.view(-1, mbs)
    if not torch.equal(blocks - blocks[:, :1], torch.arange(mbs).expand_as(blocks)):
        raise ValueError(f"each micro-batch's rows must be consecutive rows of the batch, "
                         f"got {rows.tolist()}: take them from train.step.replica_rows")
    return blocks[:, 0].tolist()


class _Run:
    """The state of one step on one rank: tensors waiting for their next action, by (mb, stage)."""

    def __init__(self, schedule, model, tokens, targets, layout, keep_outputs, track_memory,
                 rows=None):
        self.schedule, self.model, self.keep = schedule, model, keep_outputs
        self.grid, m = model.grid, schedule.microbatches
        self.mbs = tokens.shape[0] // m
        self.first_rows = _first_rows(rows, tokens.shape[0], self.mbs)
        self.shape = message_shape(model.cfg, self.grid, self.mbs, tokens.shape[1])
        cp = self.grid.cp            # this cp rank's chunks, cut in `layout` order
        tokens, targets = (shard_sequence(t, cp.size, cp.rank, layout) for t in (tokens, targets))
        self.tokens, self.targets = tokens.split(self.mbs), targets.split(self.mbs)
        self.last = schedule.n_stages - 1
        self.defers = any(a.kind == W for acts in schedule.actions.values() for a in acts)
        self.inputs, self.outputs, self.grad_out, self.grad_in = {}, {}, {}, {}
        self.loss = None
        self.aux = torch.zeros((), device=tokens.device)   # earlier stages' auxiliary losses
        self.logits, self.input_grads = [None] * m, [None] * m
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.on_cuda = self.device.type == "cuda"
        self.sends = None                # the last batch's sends, still in flight (p2p.exchange)
        # only a tracked run walks the parameters for it (off: peak_* stay 0)
        self.memory = ActivationMemory([*model.parameters(), tokens, targets] if track_memory else [])
        self.track_memory = track_memory
        self.events: list[Event] = []

    # ---- compute ------------------------------------------------------------------------
    def forward(self, mb: int, s: int) -> None:
        model = self.model
        model.rng.rows_from(self.first_rows[mb])   # its rows of the global batch
        capture = weight_grad.capture() if self.defers else contextlib.nullcontext()
        recording = self.memory.recording((mb, s)) if self.track_memory else contextlib.nullcontext()
        with capture, recording:
            if s == 0:
                x = model.embed(self.tokens[mb])
                if self.keep:
                    x.retain_grad()             # dL/dX: the verifier compares it
            else:
                x = self.inputs[(mb, s)]
            self.inputs[(mb, s)] = x
            out = model.stage_forward(s, x)
            aux = model.stage_aux_loss(s) if s != self.last else None
            if aux is not None:         # this stage's routers' terms of the loss, scaled as it is
                out = carry_aux_loss(out, aux, 1.0 / self.schedule.microbatches)
                self.aux = self.aux + aux.detach().float() / self.schedule.microbatches
            if s == self.last:
                if self.keep:
                    self.logits[mb] = out.detach().clone()
                loss = model.loss(out, self.targets[mb]) / self.schedule.microbatches
                self.loss = loss.detach() if self.loss is None else self.loss + loss.detach()
                out = loss
        self.outputs[(mb, s)] = out
        if s != self.last and self._local(s + 1):   # the next stage is here: hand it over
            self.inputs[(mb, s + 1)] = out.detach().requires_grad_()

    def backward(self, mb: int, s: int, defer: bool) -> None:
        out = self.outputs.pop((mb, s))
        grad = None if s == self.last else self.grad_out.pop((mb, s))
        deferring = weight_grad.deferring((mb, s)) if defer else contextlib.nullcontext()
        with deferring:
            torch.autograd.backward(out, grad)
        x = self.inputs.pop((mb, s))
        if s == 0:
            if self.keep:
                self.input_grads[mb] = x.grad
            return
        grad_in = x.grad
        if self._local(s - 1):
            self.grad_out[(mb, s - 1)] = grad_in
        else:
            self.grad_in[(mb, s)] = grad_in

    def weights(self, mb: int, s: int) -> None:
        weight_grad.STORE.pop((mb, s))

    def _local(self, stage: int) -> bool:
        return self.schedule.stage_rank[stage] == self.grid.pp.rank

    def act(self, action: Action) -> None:
        if action.kind == F:
            self.forward(action.microbatch, action.stage)
        elif action.kind in (B, BW):
            self.backward(action.microbatch, action.stage, defer=action.kind == B)
        else:
            self.weights(action.microbatch, action.stage)

    def compute(self, action: Action) -> None:
        start = time.perf_counter()
        pairs.run_alone(str(action), lambda: self.act(action))
        self._ran([(action, start, None)])

    def compute_pair(self, f: Action, bw: Action) -> None:
        """An overlapped (F, BW) pair run as one (pairs.py): each half's all-to-alls in flight
        while the other computes. Their events overlap in time, as the halves do."""
        spans = pairs.run_pair((str(f), lambda: self.act(f)), (str(bw), lambda: self.act(bw)),
                               self.device)
        (f_start, f_end), (bw_start, _) = spans
        self._ran([(f, f_start, f_end), (bw, bw_start, None)])

    def _ran(self, ran: list[tuple[Action, float, float | None]]) -> None:
        """Record the actions just run (end None: now, after the device's kernels)."""
        if self.on_cuda:
            torch.cuda.synchronize(self.device)    # the kernels' end, not their launch
        now = time.perf_counter()
        for action, start, end in ran:
            self.events.append(Event(self.grid.pp.rank, action.kind, action.microbatch,
                                     action.stage, start, now if end is None else end))
        if self.track_memory:
            self.memory.sample()

    # ---- messages -----------------------------------------------------------------------
    def messages(self, batch: list[Action]) -> None:
        outgoing = {}
        for a in batch:
            if a.kind == SEND_F:
                outgoing[a] = self.outputs[(a.microbatch, a.stage)]
            elif a.kind == SEND_B:
                outgoing[a] = self.grad_in.pop((a.microbatch, a.stage))
        self.wait_for_sends()            # long arrived by now: keeps one batch's sends alive at most
        received, self.sends = exchange(batch, outgoing, self.shape, self.dtype, self.device,
                                        self.grid.pp)
        for a, t in received.items():
            if a.kind == RECV_F:
                self.inputs[(a.microbatch, a.stage)] = t.requires_grad_()
            else:
                self.grad_out[(a.microbatch, a.stage)] = t

    def wait_for_sends(self) -> None:
        if self.sends is not None:
            self.sends.wait()
            self.sends = None

    def run(self, actions, on_last_backward=None, overlap: bool = False) -> None:
        batch: list[Action] = []
        tail = last_backward_tail(actions, self.schedule.microbatches)
        paired = dict(self.schedule.overlapped.get(self.grid.pp.rank, ())) if overlap else {}
        partner_of = None                # the BW already run with its F
        if tail is not None and actions[tail] in paired.values():
            tail -= 1                    # a pair's BW runs with its F, the action before it
        for i, action in enumerate(actions):
            if i == tail and on_last_backward is not None:
                on_last_backward()
            if action.kind in COMPUTE:
                if batch:
                    self.messages(batch)
                    batch = []
                if action == partner_of:
                    continue
                partner_of = paired.get(action)      # the pair's BW is the next action (check.py)
                if partner_of is not None:
                    self.compute_pair(action, partner_of)
                else:
                    self.compute(action)
            else:
                batch.append(action)
        if batch:
            self.messages(batch)
        self.wait_for_sends()


def run_schedule(schedule: Schedule, model: PipelineGPT, tokens: torch.Tensor, targets: torch.Tensor,
                 *, layout: str = "zigzag", keep_outputs: bool = True, track_memory: bool = False,
                 rows=None, finalize_grads: bool = True,
                 on_last_backward=None, start_line: bool = False,
                 overlap: bool | None = None) -> StepResult:
    """Run this rank's part of `schedule` on the global batch (the same tokens on every rank;
    a cp rank runs its own chunks of every sequence).

    Call model.rng.reset(step seed) first, like any step; gradients accumulate into .grad and
    are finalized (tp sums, cp average, tied-embedding sums) before it returns. `layout`: the order
    the sequences are cut in over cp (the model assumes zigzag). track_memory=True measures the activation
    memory (memory.py; its saved-tensor hooks slow the step: off, peak_* are 0).
    A data-parallel replica passes its rows of the batch, `rows` their global rows
    (train.step.replica_rows, by the schedule's micro-batches: dropout masks are keyed by
    global row), and finalize_grads=False: its engine's finish_grad_sync does the same sums on
    the gradient pieces it keeps.
    `on_last_backward()` is called once, where the rank's last micro-batch's backward begins
    (last_backward_tail): a data-parallel engine turns its sync on there.
    start_line=True: a barrier over every rank first, so the ranks' clocks start together (a
    measured timeline, measure.py). A training step needs none: the first messages order the
    ranks, and a barrier is one more round trip every step.
    overlap: run Schedule.overlapped's (F, BW) pairs as one, each half's all-to-alls in flight
    while the other computes (pairs.py; bit-identical to running them one after the other).
    None: wherever there is an all-to-all to hide (hides_all_to_all)."""
    check_schedule_fits(schedule, model, tokens.shape[0])
    run = _Run(schedule, model, tokens, targets, layout, keep_outputs, track_memory, rows)
    weight_grad.STORE.clear()
    if start_line:
        comm.barrier(comm.Group("world", range(model.grid.world_size)))
    if overlap is None:
        overlap = hides_all_to_all(model)
    run.run(schedule.actions[model.grid.pp.rank], on_last_backward, overlap)
    if weight_grad.STORE.queues:
        left = sorted(weight_grad.STORE.queues, key=str)
        weight_grad.STORE.clear()
        raise ValueError(f"schedule {schedule.name!r} left weight gradients of {left} un-run: "
                         "every B needs its W")
    leftover = [k for d in (run.outputs, run.grad_out, run.grad_in) for k in d]
    if leftover:
        raise ValueError(f"schedule {schedule.name!r} ended with work still waiting for "
                         f"(micro-batch, stage) {sorted(set(leftover))}: a backward or a send is missing")
    loss, cp = run.loss, model.grid.cp
    if model.cfg.n_experts and schedule.pp > 1:    # the earlier stages' auxiliary losses join it
        aux = comm.all_reduce(run.aux.reshape(1).clone(), model.grid.pp)[0]
        loss = None if loss is None else loss + aux
    if loss is not None and cp.size > 1:   # each cp rank's is the mean over its own tokens
        loss = comm.all_reduce(loss.clone(), cp) / cp.size
    if finalize_grads:
        model.finalize_grads()
    return StepResult(loss, run.logits if model.holds_last and keep_outputs else None,
                      run.input_grads if model.holds_first and keep_outputs else None,
                      run.events, run.memory.peak_bytes, run.memory.peak_alive,
                      dict(run.memory.unit_bytes))
