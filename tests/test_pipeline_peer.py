"""The peer: torch.distributed.pipelining runs the same model, split the same way, on the same
batch and micro-batches, and gives the loss, logits and every gradient that minitron's
executor gives, and that the single-device reference gives (each within float32_tolerance).

The peer is built independently of minitron's pipeline code: each rank takes the reference
GPT's own modules (same weights, same names) and wraps those of each stage in a PeerStage,
torch's one-tensor-in, one-tensor-out stage module, cut exactly as minitron cuts (stage s holds
blocks stage_layers(s), stage 0 also the embedding, the last stage the final norm and the
output layer; stages on ranks as the schedule's stage_rank says). torch's PipelineStage and its
ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B (pp 2 and 4), ScheduleInterleavedZeroBubble
(one stage per rank: ZB-H1) and ScheduleZBVZeroBubble do the sends, receives, backward and its
B/W split on gloo; minitron's side is PipelineGPT + run_schedule. Dropout is 0: torch's stages
know nothing of minitron's keyed masks. Tied embeddings (pp=2): the peer sums its two copies'
gradients itself, as Megatron does.

Losses: each micro-batch's loss is divided by the number of micro-batches on both sides (and
torch's own 1/m gradient scaling, an option only in newer torch, is turned off), so the summed
gradients are those of the reference's mean over the whole batch.

Orders. The compute order torch *runs* (recorded by wrapping its stages' forward_one_chunk,
backward_one_chunk and backward_weight_one_chunk) equals minitron's schedule of the same name
on every rank, for all five schedules. The order torch *describes* (schedule.pipeline_order,
which feeds its visualiser and, for the multi-stage schedules, its runtime) equals it too,
with one exception, and torch's interleaved schedule at one stage per rank runs a different
order (tests/test_pipeline_schedules.py checks both on a grid of shapes without processes):
  * Schedule1F1B.pipeline_order numbers the last rank's forwards from 1 (F1 BW0 F2 BW1 ... F4
    for m=4: there is no micro-batch 4). Its warm-up loop leaves forward_mb at 0 when the last
    rank has no warm-up forward, then increments before the first steady-state forward. Its
    runtime (_step_microbatches) runs F0 BW0 F1 BW1 ..., Megatron's and minitron's order.
  * ScheduleInterleaved1F1B with ONE stage per rank warms up 2(p-1-r) forwards on rank r (its
    interleaved formula, (v-1)p + 2(p-1-r), at v=1), where Megatron, for v=1, runs plain 1F1B's
    p-1-r. Both are correct schedules (the gradients agree); torch's keeps up to 2(p-1-r)+1
    micro-batches alive instead of p-r. From v=2 on the formulas agree and so do the orders.
"""
from __future__ import annotations

import copy
import dataclasses
import inspect

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from minitron.grid import ParallelConfig, build_grid
from minitron.config import ModelConfig
from minitron.model.convert import gather_state_dict, grads_state_dict, stage_layers
from minitron.model.reference import GPT
from minitron.pipeline import make_schedule
from minitron.pipeline.actions import BW, B, W
from minitron.pipeline.executor import run_schedule
from minitron.model.stages import PipelineGPT
from minitron.verify import make_batch, reference_step
from minitron.verify.checks import FLOOR, float32_tolerance
from minitron.verify.plants import Plant

pipelining = pytest.importorskip("torch.distributed.pipelining")

CFG = ModelConfig(vocab_size=64, seq_len=8, hidden=32, n_layers=4, n_heads=4, dropout=0.0)
BATCH = 8
TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                   "interleaved": "ScheduleInterleaved1F1B",
                   "zb-h1": "ScheduleInterleavedZeroBubble", "zb-v": "ScheduleZBVZeroBubble",
                   "dualpipev": "ScheduleDualPipeV"}   # DualPipeV: tests/test_dualpipev.py
MULTI = ("interleaved", "zb-h1", "zb-v", "dualpipev")   # torch's schedules taking a list of stages


class PeerStage(nn.Module):
    """Stage `stage` of the reference GPT `ref` (its own modules, so its own names and weights):
    tokens or the previous stage's activation in, the next activation or the logits out."""

    def __init__(self, ref: GPT, stage: int, n_stages: int):
        super().__init__()
        self.first, self.last, self.rng = stage == 0, stage == n_stages - 1, ref.rng
        if self.first:
            self.embedding = ref.embedding
        self.layers = nn.ModuleDict({str(i): ref.layers[i]
                                     for i in stage_layers(ref.cfg, stage, n_stages)})
        if self.last:
            self.final_norm = ref.final_norm
            # tied: this rank's own copy of the word embedding, summed with stage 0's after
            self.output = ref.embedding.word if ref.cfg.tie_embeddings else ref.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.embedding(x)
        for i, layer in self.layers.items():
            self.rng.at_layer(int(i))
            x = layer(x, self.rng)
        if self.last:
            x = self.final_norm(x) @ self.output.weight.t()
        return x


def _recorded(stage, order: list) -> None:
    """Record every compute action torch runs on `stage`, as minitron's (kind, mb, stage)."""
    forward, backward = stage.forward_one_chunk, stage.backward_one_chunk
    weight = getattr(stage, "backward_weight_one_chunk", None)

    def fwd(chunk, *args, **kwargs):
        order.append(("F", chunk, stage.stage_index))
        return forward(chunk, *args, **kwargs)

    def bwd(chunk, *args, **kwargs):
        full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
        order.append((BW if full else B, chunk, stage.stage_index))
        return backward(chunk, *args, **kwargs)

    def wgt(chunk, *args, **kwargs):
        order.append((W, chunk, stage.stage_index))
        return weight(chunk, *args, **kwargs)
    stage.forward_one_chunk, stage.backward_one_chunk = fwd, bwd
    if weight is not None:
        stage.backward_weight_one_chunk = wgt


def _torch_step(ref: GPT, name: str, placement: tuple, rank: int, m: int, tokens, targets):
    """torch's pipeline on this rank's PeerStages: (loss or None, logits or None, grads, the
    compute order it ran, the order it describes for every rank as pipeline_order or None)."""
    import torch.distributed as dist
    cfg, n_stages, mbs = ref.cfg, len(placement), tokens.shape[0] // m

    def loss_fn(logits, target):
        return F.cross_entropy(logits.float().flatten(0, 1), target.flatten()) / m

    stages, order = [], []
    for s in (s for s, r in enumerate(placement) if r == rank):
        act = torch.zeros(mbs, cfg.seq_len, cfg.hidden, requires_grad=True)
        out = torch.zeros(mbs, cfg.seq_len, cfg.vocab_size if s == n_stages - 1 else cfg.hidden,
                          requires_grad=True)
        # example tensors (static shapes: no metadata exchange); requires_grad on the
        # activations, or torch sends no gradient back to the previous stage
        stage = pipelining.PipelineStage(PeerStage(ref, s, n_stages), s, n_stages,
                                         torch.device("cpu"),
                                         input_args=tokens[:mbs] if s == 0 else act,
                                         output_args=out)
        _recorded(stage, order)
        stages.append(stage)
    cls = getattr(pipelining, TORCH_SCHEDULES[name])     # present: the test checked (torch_has)
    kwargs = {"loss_fn": loss_fn}
    if "scale_grads" in inspect.signature(cls.__init__).parameters:
        kwargs["scale_grads"] = False            # the loss is already divided by m
    schedule = cls(stages if name in MULTI else stages[0], m, **kwargs)
    losses: list = []
    logits = schedule.step(*((tokens,) if rank == 0 else ()), target=targets, losses=losses)
    if cfg.tie_embeddings:   # Megatron's sum of the two copies (pp=2: the world is the
        dist.all_reduce(ref.embedding.word.weight.grad)   # first and the last rank)
    last = rank == placement[-1]
    loss = torch.stack([x.detach() for x in losses]).sum() if last else None
    grads = {k: g.clone() for k, g in grads_state_dict(ref).items()}
    kinds = {"F": "F", "B": BW, "I": B, "W": W}     # torch's "B" is a full backward, "I" dL/dX
    described = getattr(schedule, "pipeline_order", None)   # older torch: multi-stage ones only
    if described is not None:
        described = {r: [(kinds[a.computation_type.value], a.microbatch_index, a.stage_index)
                         for a in acts if a is not None and a.computation_type.value in kinds]
                     for r, acts in described.items()}
    return loss, logits.detach() if last else None, grads, order, described


def _minitron_step(ref: GPT, name: str, pp: int, virtual: int, m: int, tokens, targets, plant):
    schedule = make_schedule(name, pp, m, virtual)
    grid = build_grid(ParallelConfig(pp=pp))
    model = PipelineGPT.from_reference(ref, grid, placement=schedule.stage_rank)
    model.rng.reset(0)
    with Plant(plant).step():
        result = run_schedule(schedule, model, tokens, targets)
    logits = torch.cat(result.logits) if result.logits is not None else None
    # the reference's names and layout (q, k, v apart), assembled over the stages (collective)
    grads = gather_state_dict(grads_state_dict(model), ref.cfg, grid, schedule.stage_rank)
    order = [(e.kind, e.microbatch, e.stage) for e in result.events]
    expected = [(a.kind, a.microbatch, a.stage) for a in schedule.compute(grid.pp.rank)]
    return result.loss, logits, grads, order, expected


def _peer_rank(name: str, virtual: int, m: int, cfg: ModelConfig, plant: str | None = None):
    """On every rank: the torch peer's and minitron's step on the same weights and batch."""
    import torch.distributed as dist
    pp, rank = dist.get_world_size(), dist.get_rank()
    tokens, targets = make_batch(0, 0, BATCH, cfg.seq_len, cfg.vocab_size)
    ref = GPT(cfg, seed=0)
    placement = make_schedule(name, pp, m, virtual).stage_rank
    peer = _torch_step(copy.deepcopy(ref), name, placement, rank, m, tokens, targets)
    ours = _minitron_step(ref, name, pp, virtual, m, tokens, targets, plant)
    return {"torch": peer, "minitron": ours}


def _merge(results: list[dict], side: str) -> dict:
    """One side's loss, logits and gradients over all ranks (each gradient from its holder;
    a tied embedding held twice is the same summed tensor on both)."""
    loss = next(r[side][0] for r in results if r[side][0] is not None)
    logits = next(r[side][1] for r in results if r[side][1] is not None)
    grads = {}
    for r in results:
        grads.update(r[side][2])
    return {"loss": loss, "logits": logits, **{f"grad {k}": g for k, g in grads.items()}}


def _reference(cfg: ModelConfig) -> dict:
    ref = GPT(cfg, seed=0)
    tokens, targets = make_batch(0, 0, BATCH, cfg.seq_len, cfg.vocab_size)
    _, logits, loss = reference_step(ref, tokens, targets, 0)
    return {"loss": loss.detach(), "logits": logits.detach(),
            **{f"grad {k}": g for k, g in grads_state_dict(ref).items()}}


def disagreements(actual: dict, expected: dict, tol: float) -> list[str]:
    """Every tensor of `expected` that `actual` lacks or has beyond tol. The error is relative
    to the tensor's largest entry, but for gradients never to less than verify.checks.FLOOR of
    the largest gradient entry in the model (the verifier's rule, grad_rows: the key bias's
    gradient is zero up to rounding and has no scale of its own)."""
    out = [f"{k}: missing" for k in expected if k not in actual]
    out += [f"{k}: not in the reference" for k in actual if k not in expected]
    floor = FLOOR * max(v.abs().max().item() for k, v in expected.items() if k.startswith("grad"))
    for k, v in expected.items():
        if k in actual:
            scale = max(v.abs().max().item(), floor if k.startswith("grad") else 0.0)
            err = (actual[k].double() - v.double()).abs().max().item() / scale
            if not err <= tol:        # NaN too
                out.append(f"{k}: rel err {err:.2e} > {tol:.1e}")
    return out


CASES = {   # id: (schedule, virtual, micro-batches, model, world size)
    "gpipe": ("gpipe", 1, 4, CFG, 2),
    "1f1b": ("1f1b", 1, 4, CFG, 2),
    "interleaved-v2": ("interleaved", 2, 4, CFG, 2),
    "1f1b-tied-m2": ("1f1b", 1, 2, dataclasses.replace(CFG, tie_embeddings=True), 2),
    "zb-h1": ("zb-h1", 1, 4, CFG, 2),
    "zb-v": ("zb-v", 2, 4, CFG, 2),
    "interleaved-pp4-v2": ("interleaved", 2, 8, dataclasses.replace(CFG, n_layers=8), 4),
}


def torch_has(name: str) -> None:
    """Skip (allowed in strict mode only where it is true) when this torch lacks the schedule."""
    if not hasattr(pipelining, TORCH_SCHEDULES[name]):
        pytest.skip(f"torch {torch.__version__}'s pipelining has no {TORCH_SCHEDULES[name]}")


@pytest.mark.parametrize("case", CASES)
def test_torch_pipelining_agrees(run_ranks, case):
    """Loss, logits and every gradient: torch's pipeline = minitron's executor = the reference,
    each within float32_tolerance; and torch runs the compute order minitron's schedule lists."""
    name, virtual, m, cfg, world = CASES[case]
    torch_has(name)
    results = run_ranks(_peer_rank, name, virtual, m, cfg, world_size=world)
    peer, ours, ref = _merge(results, "torch"), _merge(results, "minitron"), _reference(cfg)
    assert len(ref) == 2 + len(list(GPT(cfg).parameters()))
    tol = float32_tolerance(cfg, BATCH, cfg.seq_len)
    assert disagreements(peer, ref, tol) == []
    assert disagreements(ours, ref, tol) == []
    assert disagreements(ours, peer, tol) == []
    described = results[0]["torch"][4]
    for rank, r in enumerate(results):
        torch_ran, minitron_ran, listed = r["torch"][3], r["minitron"][3], r["minitron"][4]
        assert torch_ran == listed, f"rank {rank}: torch ran {torch_ran}, minitron lists {listed}"
        assert minitron_ran == listed
        if described is not None:
            allowed = [listed]
            if name == "1f1b" and rank == world - 1:   # the module docstring's off-by-one
                allowed.append([(k, mb + (k == "F"), s) for k, mb, s in listed])
            assert described[rank] in allowed, f"rank {rank}: torch describes {described[rank]}"


def one_f_one_b(rank: int, warmup: int, m: int) -> list[tuple]:
    """1F1B's compute order on a one-stage-per-rank pipeline with `warmup` warm-up forwards."""
    order = [("F", i, rank) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", i + warmup, rank), (BW, i, rank)]
    return order + [(BW, i, rank) for i in range(m - warmup, m)]


def test_torch_interleaved_with_one_stage_per_rank_warms_up_twice_as_long(run_ranks):
    """The one place where torch runs a different order from minitron's schedule of the same
    name: ScheduleInterleaved1F1B with one stage per rank warms up 2(p-1-r) forwards (its
    interleaved formula (v-1)p + 2(p-1-r) at v=1); Megatron, and minitron's 'interleaved' at
    virtual=1, run plain 1F1B's p-1-r. A different valid order: the gradients still agree."""
    m, pp = 4, 2
    results = run_ranks(_peer_rank, "interleaved", 1, m, CFG, world_size=pp)
    tol = float32_tolerance(CFG, BATCH, CFG.seq_len)
    assert disagreements(_merge(results, "minitron"), _merge(results, "torch"), tol) == []
    for rank, r in enumerate(results):
        assert r["minitron"][4] == one_f_one_b(rank, min(pp - 1 - rank, m), m)
        assert r["torch"][3] == one_f_one_b(rank, min(2 * (pp - 1 - rank), m), m)


def test_a_planted_executor_bug_is_caught_by_the_peer(run_ranks):
    """The test of the test: minitron's executor passing back the gradient it received instead
    of dL/d(input) (verify.plants' pp-wrong-stage; only middle stages have one to pass, so
    interleaved, 4 stages) disagrees with torch's pipeline on every layer before that stage."""
    results = run_ranks(_peer_rank, "interleaved", 2, 4, CFG, "pp-wrong-stage", world_size=2)
    tol = float32_tolerance(CFG, BATCH, CFG.seq_len)
    bad = disagreements(_merge(results, "minitron"), _merge(results, "torch"), tol)
    assert bad and all(k.startswith(("grad layers.0.", "grad layers.1.", "grad layers.2.",
                                     "grad embedding.")) for k in bad), bad
    assert any(k.startswith("grad embedding.") for k in bad)
