"""Pipeline schedules: who computes what, in which order, and which tensors travel.

Every schedule is a pure function (pp, microbatches, virtual) -> Schedule (see actions.py).
It decides only each rank's *compute order*; `with_messages` (messages.py) derives the messages from it:
a SEND_F after each F whose next stage is on another rank and the matching RECV_F on that
rank, a SEND_B/RECV_B pair for each B or BW whose previous stage is elsewhere. Each message is
placed on both ranks at the moment its tensor is made in an as-soon-as-possible run, so a send
follows its producer, a receive comes before its consumer (early enough to prefetch, as
Megatron's interleaved schedule does), and neighbouring sends and receives fall into one batch:
1F1B's steady state F, SEND_F, RECV_B, BW is Megatron's send_forward_recv_backward. Placing
receives just before their use instead deadlocks interleaved 1F1B (tests show it).

Bubbles, with p ranks, m micro-batches and a stage's F, B, W costs (BW = B + W):
  GPipe        all F, then all BW. Idle per rank (p-1)(F+B+W); peak activations m.
  1F1B         p-1-r warm-up forwards on rank r, then one F one BW, then the cool-down BWs.
               Same idle as GPipe, (p-1)/(m+p-1) of the time, but at most p micro-batches alive.
  interleaved  v chunks per rank (stage s on rank s % p), each 1/v of a stage: the warm-up and
               cool-down steps are v times shorter, idle (p-1)(F+B+W)/v. Needs m % p == 0.
  ZB-H1        1F1B with BW split into B (dL/dinput: the next rank waits for it) and W (dL/dweights:
               nobody waits for it). Rank r defers its first r W's, so the B's run back to back
               in the cool-down and the W's fill the gaps: idle (p-1)(F+B-W), a third of 1F1B's
               at F=B=W, with 1F1B's p micro-batches alive on rank 0.
  ZB-H2        up to 2p-1 micro-batches alive instead of p: extra warm-up F's and tail W's fill
               every gap (m >= 2p-1, F=B=W); only the start-up skew (p-1)F is left.
  ZB-V         2 chunks per rank in a V (rank r holds stages r and 2p-1-r): the last rank turns
               the forward around without sending it, and W's fill the rest. At F=B=W and
               m >= 2p-1 (see zb_v) every rank works without a gap from its first action to its
               last; the only idle left is the start-up skew (p-1)F/2 per rank that consecutive
               iterations overlap, with 1F1B's peak of p stage-sized activations.
  DualPipeV    ZB-V's V with DeepSeek's steady state: pairs of one micro-batch's F and another's
               BW, run as one overlapped unit (dualpipev.py); its point is what the pair hides
               (the MoE all-to-all), which simulate(..., overlap=True) shows.
"""
from __future__ import annotations

from .actions import B, BW, F, W, Action, Schedule, check_args, interleaved_placement, v_placement
from .dualpipev import dualpipev
from .messages import with_messages


def gpipe(pp: int, microbatches: int, virtual: int = 1) -> Schedule:
    """GPipe: every micro-batch forward, then every micro-batch backward (in the same order)."""
    check_args("gpipe", pp, microbatches, virtual, (1,))
    compute = {r: [Action(F, i, r) for i in range(microbatches)]
               + [Action(BW, i, r) for i in range(microbatches)] for r in range(pp)}
    return with_messages("gpipe", pp, microbatches, 1, interleaved_placement(pp, 1), compute)


def _one_f_one_b_order(pp: int, m: int, rank: int, backward: str) -> list[Action]:
    """Megatron's non-interleaved order: warm-up forwards, F/backward pairs, cool-down backwards."""
    warmup = min(pp - 1 - rank, m)
    order = [Action(F, i, rank) for i in range(warmup)]
    for i in range(m - warmup):                       # steady state: F of i+warmup, then back i
        order += [Action(F, i + warmup, rank), Action(backward, i, rank)]
    order += [Action(backward, i, rank) for i in range(m - warmup, m)]
    return order


def one_f_one_b(pp: int, microbatches: int, virtual: int = 1) -> Schedule:
    """1F1B (PipeDream-Flush, Megatron's forward_backward_pipelining_without_interleaving)."""
    check_args("1f1b", pp, microbatches, virtual, (1,))
    compute = {r: _one_f_one_b_order(pp, microbatches, r, BW) for r in range(pp)}
    return with_messages("1f1b", pp, microbatches, 1, interleaved_placement(pp, 1), compute)


def interleaved(pp: int, microbatches: int, virtual: int = 2) -> Schedule:
    """Megatron's interleaved 1F1B (forward_backward_pipelining_with_interleaving).

    Rank r holds stages r, r+p, ... (chunk c = stage c*p + r). Work is counted in *virtual*
    micro-batches k = 0 .. m*v-1, taken in groups of p micro-batches per chunk (Megatron's
    schedule table with microbatch_group_size_per_vp_stage = p): k -> micro-batch
    (k // (p v)) p + k % p, forward chunk (k % (p v)) // p, backward chunk v-1 minus that.
    Warm-up (p-1-r)*2 + (v-1)*p forwards (all of them if that reaches m*v), then one forward
    one backward, then the remaining backwards.
    """
    check_args("interleaved", pp, microbatches, virtual, tuple(range(1, 65)))
    if microbatches % pp:
        raise ValueError(f"interleaved: microbatches ({microbatches}) must be a multiple of pp "
                         f"({pp}), as Megatron requires; use e.g. {pp * -(-microbatches // pp)}")
    total = microbatches * virtual

    def unit(k: int, forward: bool, rank: int) -> Action:
        mb = (k // (pp * virtual)) * pp + k % pp
        chunk = (k % (pp * virtual)) // pp
        if not forward:
            chunk = virtual - 1 - chunk
        return Action(F if forward else BW, mb, chunk * pp + rank)

    compute = {}
    for r in range(pp):
        warmup = min((pp - 1 - r) * 2 + (virtual - 1) * pp, total)
        if virtual == 1:        # one chunk per rank: Megatron runs plain 1F1B instead
            warmup = min(pp - 1 - r, total)
        order = [unit(k, True, r) for k in range(warmup)]
        for k in range(total - warmup):
            order += [unit(k + warmup, True, r), unit(k, False, r)]
        order += [unit(k, False, r) for k in range(total - warmup, total)]
        compute[r] = order
    return with_messages("interleaved", pp, microbatches, virtual,
                         interleaved_placement(pp, virtual), compute)


def zb_h1(pp: int, microbatches: int, virtual: int = 1) -> Schedule:
    """ZB-H1 (Qi et al. 2024, sec. 2.1): 1F1B's order with BW split into B then W, and rank r
    holding back its first r W's. B is all the previous rank waits for, so the B's race back
    through the pipeline; each rank keeps p micro-batches in flight (1F1B's rank 0 peak) and
    runs the deferred W's where 1F1B's cool-down idled. Steady state: F, B, W of the oldest."""
    check_args("zb-h1", pp, microbatches, virtual, (1,))
    compute = {}
    for r in range(pp):
        order, pending, held = [], [], 0
        for a in _one_f_one_b_order(pp, microbatches, r, B):
            order.append(a)
            if a.kind == B:
                pending.append(Action(W, a.microbatch, r))
                if held < r:
                    held += 1                      # defer: keeps p micro-batches alive
                else:
                    order.append(pending.pop(0))
        compute[r] = order + pending
    return with_messages("zb-h1", pp, microbatches, 1, interleaved_placement(pp, 1), compute)


def zb_v(pp: int, microbatches: int, virtual: int = 2) -> Schedule:
    """ZB-V (Qi et al. 2024, sec. 6): two chunks per rank in a V, rank r holding stage r
    (chunk 0) and stage 2p-1-r (chunk 1); the handcrafted order of the paper (the same as
    torch.distributed.pipelining's ScheduleZBVZeroBubble). Phases on rank r:
      warm-up   2(p-r)-1 F of chunk 0; then r times (F chunk 1, F chunk 0);
                then p-r times (F, B, W of chunk 1)
      steady    F chunk 0, B W chunk 0, F chunk 1, B W chunk 1    (until all F are done)
      cool-down r times (B chunk 0, B chunk 1); p-r times (B chunk 0, W chunk 0); the rest W.
    The pattern is written for m >= 2p-1 micro-batches; below that it is built for 2p-1 and
    the missing micro-batches are dropped. At F=B=W and m >= 2p-1 no rank ever idles between
    its first and its last action (test_zb_v_zero_bubble); peak activations p, 1F1B's.
    """
    check_args("zb-v", pp, microbatches, virtual, (2,))
    n, m = 2 * pp, max(2 * pp - 1, microbatches)
    compute = {}
    for r in range(pp):
        s0, s1 = r, n - 1 - r
        count = {(k, c): 0 for k in (F, B, W) for c in (0, 1)}
        order: list[Action] = []

        def put(kind, chunk, mb=None):
            i = count[kind, chunk] if mb is None else mb
            order.append(Action(kind, i, (s0, s1)[chunk]))
            if mb is None:
                count[kind, chunk] += 1
        for _ in range(2 * (pp - r) - 1):
            put(F, 0)
        for _ in range(r):
            put(F, 1), put(F, 0)
        for _ in range(pp - r):
            put(F, 1), put(B, 1), put(W, 1)
        while count[F, 1] < count[F, 0] or count[F, 0] < m:
            if count[F, 0] < m:
                put(F, 0)
            put(B, 0), put(W, 0), put(F, 1), put(B, 1), put(W, 1)
        for _ in range(r):
            put(B, 0), put(B, 1)
        for _ in range(pp - r):
            put(B, 0), put(W, 0)
        while count[W, 1] < count[B, 1]:
            put(W, 1)
        while count[W, 0] < count[B, 0]:
            put(W, 0)
        compute[r] = [a for a in order if a.microbatch < microbatches]
    return with_messages("zb-v", pp, microbatches, 2, v_placement(pp), compute)


def zb_h2(pp: int, microbatches: int, virtual: int = 1) -> Schedule:
    """ZB-H2 (Qi et al. 2024, sec. 2.2): trade memory for the whole bubble. Up to 2p-1
    micro-batches alive per rank (the paper's (2p-1) M_B) lets the warm-up run extra F's and
    the tail run W's, so at F=B=W and m >= 2p-1 every rank works without a gap from its first
    action to its last: the trapezoid becomes a parallelogram, idle only the skew (p-1)F.
    Built by one greedy rule, stepped in unit time (F=B=W=1): a free rank runs its next B if the
    gradient is there, else its next F if its input is there and fewer than 2p-1 are alive,
    else its oldest pending W."""
    check_args("zb-h2", pp, microbatches, virtual, (1,))
    m, limit, made = microbatches, 2 * pp - 1, {}
    order: dict[int, list[Action]] = {r: [] for r in range(pp)}
    pending: dict[int, list[int]] = {r: [] for r in range(pp)}
    t = 0
    while any(len(o) < 3 * m for o in order.values()):
        for r, o in order.items():
            n_f, n_b = sum(a.kind == F for a in o), sum(a.kind == B for a in o)
            if o and made[o[-1].kind, o[-1].microbatch, r] > t:
                continue                                  # still busy
            alive = n_f - sum(a.kind == W for a in o)
            if n_b < n_f and (r == pp - 1 or made.get((B, n_b, r + 1), t + 1) <= t):
                a = Action(B, n_b, r)
                pending[r].append(n_b)
            elif n_f < m and alive < limit and (r == 0 or made.get((F, n_f, r - 1), t + 1) <= t):
                a = Action(F, n_f, r)
            elif pending[r]:
                a = Action(W, pending[r].pop(0), r)
            else:
                continue
            o.append(a)
            made[a.kind, a.microbatch, r] = t + 1
        t += 1
    return with_messages("zb-h2", pp, m, 1, interleaved_placement(pp, 1), order)


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved, "zb-h1": zb_h1,
             "zb-h2": zb_h2, "zb-v": zb_v, "dualpipev": dualpipev}
V_SHAPED = ("zb-v", "dualpipev")     # two chunks per rank in a V, whatever virtual_pp says


def make_schedule(name: str, pp: int, microbatches: int, virtual: int | None = None) -> Schedule:
    """The schedule `name` for pp ranks and `microbatches` micro-batches, validated up front.
    virtual (stages per rank) defaults to the schedule's own: 2 for interleaved, zb-v and
    dualpipev, else 1."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    if virtual is None:
        return SCHEDULES[name](pp, microbatches)
    return SCHEDULES[name](pp, microbatches, virtual)
