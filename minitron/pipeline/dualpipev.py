"""DualPipeV: DeepSeek-V3's DualPipe folded onto ZB-V's V-shaped placement.

DualPipe (DeepSeek-V3 technical report, sec. 3.2.1) feeds micro-batches into both ends of the
pipeline at once, so every device holds two copies of the model's stages. DualPipeV ("cut in
half", the DualPipe repository; torch.distributed.pipelining's ScheduleDualPipeV) keeps one
copy: p ranks, 2p stages in a V (rank r holds stage r, chunk 0, and stage 2p-1-r, chunk 1), the
turn at the last rank handed over in memory, as in ZB-V. What makes it DeepSeek's is the steady
state: each step pairs the forward of one micro-batch on one chunk with the full backward of
another on the other chunk, (F, BW), which a GPU runs as one *overlapped* pair, the compute of
each hiding the other's MoE all-to-all (dispatch and combine). Phases on rank r (torch's
_calculate_single_rank_operations; W's come from a queue of the B's not yet weighted):
  1  2(p-1-r) F of chunk 0
  2  r+1 times (F chunk 0, F chunk 1)
  3  p-1-r times (B chunk 1, oldest pending W, F chunk 1)              zero-bubble warm-up
  4  m-2p+r+1 times ([F chunk 0 + BW chunk 1], [F chunk 1 + BW chunk 0])   overlapped pairs
     (the last rank runs its very first F chunk 0, BW chunk 1 apart: a shorter bubble)
  5  p-1-r times (BW chunk 1, [F chunk 1 + BW chunk 0])
  6  r+1 times (backward chunk 1, backward chunk 0): BW in the first half, B in the second
  7  p-1-r times (oldest pending W, backward chunk 0)
  8  r+1 times the oldest pending W
Written for m >= 2p micro-batches (torch refuses fewer); below that it is built for 2p and the
missing micro-batches are dropped, as zb_v does, which keeps every dependency in order.

The paper's Table 2, with PP stages (here 2p) and per-chunk times F, B, W, F&B the time of
one overlapped (F, BW) pair: DualPipe's bubble (PP/2-1)(F&B+B-3W) and activations PP+1 chunks
per device; DualPipeV has the same bubble and activation count on PP/2 = p devices. In
minitron's units (check.peak_activations counts a chunk as half a stage) that is p + 1/2.
"""
from __future__ import annotations

from .actions import B, BW, F, W, Action, Schedule, check_args, v_placement
from .messages import with_messages


def _rank_order(pp: int, m: int, r: int) -> tuple[list[Action], list[tuple[Action, Action]]]:
    """Rank r's compute order and its overlapped (F, BW) pairs, for m >= 2p micro-batches."""
    stage = (r, 2 * pp - 1 - r)                     # chunk -> stage
    forwards, backwards = [0, 0], [0, 0]           # next micro-batch per chunk
    weights: list[Action] = []                     # W's owed by B's, oldest first
    order: list[Action] = []
    pairs: list[tuple[Action, Action]] = []

    def forward(chunk: int) -> Action:
        a = Action(F, forwards[chunk], stage[chunk])
        forwards[chunk] += 1
        order.append(a)
        return a

    def backward(chunk: int, full: bool = True) -> Action:
        a = Action(BW if full else B, backwards[chunk], stage[chunk])
        backwards[chunk] += 1
        order.append(a)
        if not full:
            weights.append(Action(W, a.microbatch, a.stage))
        return a

    def weight() -> None:
        if weights:
            order.append(weights.pop(0))

    def overlapped(f_chunk: int) -> None:           # F of one chunk + BW of the other
        pairs.append((forward(f_chunk), backward(1 - f_chunk)))

    for _ in range(2 * (pp - 1 - r)):
        forward(0)
    for _ in range(r + 1):
        forward(0), forward(1)
    for _ in range(pp - 1 - r):
        backward(1, full=False), weight(), forward(1)
    for i in range(m - 2 * pp + r + 1):
        if i == 0 and r == pp - 1:
            forward(0), backward(1)
        else:
            overlapped(0)
        overlapped(1)
    for _ in range(pp - 1 - r):
        backward(1), overlapped(1)
    split = False                                   # the second half uses B + W
    for i in range(r + 1):
        split = split or (i == (r + 1) // 2 and r % 2 == 1)
        backward(1, full=not split)
        split = split or (i == (r + 1) // 2 and r % 2 == 0)
        backward(0, full=not split)
    for _ in range(pp - 1 - r):
        weight(), backward(0, full=not split)
    for _ in range(r + 1):
        weight()
    return order, pairs


def dualpipev(pp: int, microbatches: int, virtual: int = 2) -> Schedule:
    """DualPipeV on pp ranks (2pp stages in a V); see the module docstring."""
    check_args("dualpipev", pp, microbatches, virtual, (2,))
    m = max(microbatches, 2 * pp)
    compute, overlapped = {}, {}
    for r in range(pp):
        order, pairs = _rank_order(pp, m, r)
        compute[r] = [a for a in order if a.microbatch < microbatches]
        overlapped[r] = tuple((f, b) for f, b in pairs
                              if f.microbatch < microbatches and b.microbatch < microbatches)
    return with_messages("dualpipev", pp, microbatches, 2, v_placement(pp), compute,
                         overlapped=overlapped)
