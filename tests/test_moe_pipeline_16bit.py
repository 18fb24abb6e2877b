"""16-bit experts inside pipeline stages (verify/routing.py MicroBatchRouting): the routers run
micro-batch by micro-batch on both sides, their choices are compared row for row, and with
--reference-routing the split model takes the reference's choices for exactly the rows each
micro-batch holds.

The rounding flip of a top-k these tests judge is planted, not waited for: which seed flips a
choice by itself depends on the CPU's bf16 kernels (oneDNN's AMX / avx512_bf16 paths round
otherwise than AVX2's; seed 6 flips one at step 1 under ATEN_CPU_CAPABILITY=default only). At
step 0 the split side's last MoE layer, on replica 0, nudges the 3rd-best score of one token
whose 2nd/3rd gap is 1-2.5 bf16 roundings to just above its 2nd (nudged()): a near tie stepped
over, by the one token a rounding alone would not flip (those flip at < 1.2 roundings). Each
planted run is held to the same run unplanted plus that one flip: counted without the flag,
failing its step; judged a near tie with it (the default in 16 bits) and passing; the worst
expert given instead (a gap over 12 roundings) fails with it (unpipelined: test_moe_16bit's
moe-topk plant). Imposing another micro-batch's choices fails."""
import pytest
import torch

from minitron import verify
from minitron.grid import ParallelConfig
from minitron.model import ModelConfig
from minitron.moe import layer as moe_layer
from minitron.verify import plants, routing
from minitron.verify.patching import patched

PCFG = ParallelConfig(pp=2, ep=2)
MOE = ModelConfig(vocab_size=128, seq_len=16, hidden=64, n_layers=2, n_heads=4, dropout=0.1,
                  n_experts=4, topk=2, z_loss_coeff=1e-3)      # the command line's defaults
SEED, STEP = 6, 0
EPS = torch.finfo(torch.bfloat16).eps


def _run(**kw):
    return verify.verify(PCFG, MOE, steps=2, dtype=torch.bfloat16, seed=SEED, **kw)


def _routing(report):
    return [r for r in report.rows if r.quantity.startswith("moe routing")]


# in bf16 roundings: within routing.NEAR_TIE (4) with room for the two sides' scores to differ
# (flips by themselves seen up to 1.2 roundings), and over what a rounding alone flips
NEAR = (1.0, 2.5)
FAR = (3.0 * routing.NEAR_TIE, torch.inf)


def nudged(logits: torch.Tensor, k: int, overtaker: int, band) -> tuple[torch.Tensor, bool]:
    """`logits` [n, E] with one token's expert of rank `overtaker` (0 = best) raised to just above
    its k-th best: the token whose gap between the two is least within `band` (in roundings of
    its largest |score|, as routing.beyond_rounding counts), if any (else unchanged, False)."""
    s = logits.detach()
    order = s.float().argsort(-1, descending=True)
    top = s.float().gather(-1, order)
    gap = (top[:, k - 1] - top[:, overtaker]) / (EPS * top.abs().amax(-1))
    inside = (gap >= band[0]) & (gap <= band[1])
    if not inside.any():
        return logits, False
    t = int(torch.where(inside, gap, torch.inf).argmin())
    e, kth = int(order[t, overtaker]), s[t, order[t, k - 1]]
    mask = torch.zeros_like(s, dtype=torch.bool)
    mask[t, e] = True
    above = torch.nextafter(kth, torch.tensor(torch.inf, dtype=s.dtype))
    out = torch.where(mask, above + (logits - s), logits)     # the gradient is the router's own
    assert out[t, e] > kth, "the nudge did not overtake"
    return out, True


def plant_flip(monkeypatch, overtaker: int = 2, band=NEAR):
    """At step STEP the split side's last MoE layer (the last stage), on replica 0, routes its
    first micro-batch holding a token in `band` by nudged() scores: exactly one token's top-k
    changes. The reference (moe/reference.py's layers) and every other layer, step and rank are
    untouched."""
    state = {"step": -1, "done": False}
    step, forward, route = plants.Plant.step, moe_layer.ParallelMoE.forward, moe_layer.route

    def counted(self):               # once per step of the split side (train/step.py)
        state["step"] += 1
        return step(self)

    def planted(logits, cfg, bias=None, imposed=None):
        logits, state["done"] = nudged(logits, cfg.topk, overtaker, band)
        return route(logits, cfg, bias, imposed)

    def forward_until_flipped(self, x):
        g = self.grid
        if state["step"] != STEP or state["done"] or g.pp.rank != g.pp.size - 1 or g.ep_dp.rank:
            return forward(self, x)
        with patched(moe_layer, "route", planted):
            return forward(self, x)
    monkeypatch.setattr(plants.Plant, "step", counted)
    monkeypatch.setattr(moe_layer.ParallelMoE, "forward", forward_until_flipped)


@pytest.fixture(scope="module")
def unplanted():
    """The runs without the plant, flag off and on: a CPU's own rounding flips (their number
    depends on its bf16 kernels; at SEED none at step STEP, one at step 1 under
    ATEN_CPU_CAPABILITY=default) are counted in both, so the planted runs are held to these plus
    the one planted."""
    return {flag: _run(reference_routing=flag) for flag in (False, True)}


def _flips(report):
    """(own top-k pairs differing, near ties) at STEP, from the flagged routing row."""
    words = _routing(report)[STEP].quantity.split()
    return int(words[words.index("in") + 1]), int(words[words.index("near") - 1])


def test_a_flip_is_counted_micro_batch_by_micro_batch(monkeypatch, unplanted):
    plant_flip(monkeypatch)
    base = unplanted[False]
    report = _run(reference_routing=False)
    expected = [r.err + (r.step == STEP) for r in _routing(base)]     # here [0, 0] -> [1, 0]
    assert [r.err for r in _routing(report)] == expected, report.table()   # of 512 choices
    # and what follows from it: that step's outputs and gradients (both sides update from the
    # reference's gradients, so the next step starts level again)
    assert {r.step for r in report.failures} == {STEP} | {r.step for r in base.failures}


def test_the_reference_choices_taken_per_micro_batch_pass(monkeypatch, unplanted):
    plant_flip(monkeypatch)
    report = _run()           # the default in 16 bits: the reference's choices taken
    assert report.passed, report.verdict()
    differ, ties = _flips(unplanted[True])                           # here 0, 0
    assert _flips(report) == (differ + 1, ties + 1), report.table()
    assert _routing(report)[STEP].err == 0


def test_a_flip_by_a_large_gap_fails_with_the_reference_choices(monkeypatch, unplanted):
    plant_flip(monkeypatch, overtaker=MOE.n_experts - 1, band=FAR)   # the worst expert: no near tie
    report = _run()
    row = _routing(report)[STEP]
    differ, ties = _flips(unplanted[True])
    assert _flips(report) == (differ + 1, ties) and row.err == 1, report.table()
    assert "the router chose wrongly" in row.detail
    assert {r.quantity for r in report.failures} == {row.quantity}, report.table()


def test_another_micro_batchs_choices_imposed_are_caught(monkeypatch):
    start = routing.MicroBatchRouting.start

    def shifted(self, shape, imposed):      # a planted bug: each row gets the next row's choices
        start(self, shape, None if imposed is None else [c.roll(1, dims=0) for c in imposed])
    monkeypatch.setattr(routing.MicroBatchRouting, "start", shifted)
    report = _run(reference_routing=True)
    assert not report.passed
    assert all(r.err > 0 for r in _routing(report))
