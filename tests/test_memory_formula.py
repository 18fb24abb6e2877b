"""minitron.estimate.activations against the paper's Table 2 (Korthikanti et al., 2022) and against
what a real ParallelGPT block saves for backward, measured with saved_tensors_hooks."""
import re

import pytest
import torch
import torch.distributed as dist

from minitron.context_parallel.measure import saved_bytes
from minitron.grid import ParallelConfig, build_grid
from minitron.estimate.activations import MINITRON, PAPER, layer_bytes, layer_terms
from minitron.config import ModelConfig
from minitron.model.parallel import ParallelGPT

SHAPES = [dict(b=1, s=2048, h=12288, a=96), dict(b=4, s=512, h=1024, a=16), dict(b=2, s=16, h=32, a=8)]

# The paper's rows, in its own closed forms (bytes per layer per rank), written out here
# independently of the module's term-by-term construction.
PAPER_ROWS = {
    "no parallelism": (dict(), lambda b, s, h, a, t: 34 * s * b * h + 5 * a * s * s * b),
    "tensor parallel": (dict(), lambda b, s, h, a, t: 10 * s * b * h + (24 * s * b * h + 5 * a * s * s * b) // t),
    "tensor + sequence parallel": (dict(sp=True, regather=True),
                                   lambda b, s, h, a, t: (34 * s * b * h + 5 * a * s * s * b) // t),
    "tensor parallel + selective recompute": (dict(recompute="selective"),
                                              lambda b, s, h, a, t: 10 * s * b * h + 24 * s * b * h // t),
    "tensor + sequence parallel + selective recompute": (dict(sp=True, regather=True, recompute="selective"),
                                                         lambda b, s, h, a, t: 34 * s * b * h // t),
    "full recompute": (dict(recompute="full"), lambda b, s, h, a, t: 2 * s * b * h),
}
CASES = [(row, t) for row in PAPER_ROWS for t in ((1,) if row == "no parallelism" else (1, 2, 4, 8))]


@pytest.mark.parametrize("row, t", CASES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda d: "b{b}s{s}h{h}a{a}".format(**d))
def test_paper_table_2(shape, row, t):
    options, closed_form = PAPER_ROWS[row]
    assert layer_bytes(t=t, precision=PAPER, **shape, **options) == closed_form(t=t, **shape)


def test_sp_without_regather_keeps_the_gathered_inputs_whole():
    # minitron's SP: the two all-gathered matmul inputs (2sbh each in the paper's units) stay
    # full; everything else of 34sbh + 5as^2b is divided by t.
    for shape in SHAPES:
        b, s, h, a = shape.values()
        for t in (2, 4, 8):
            got = layer_terms(t=t, sp=True, precision=PAPER, **shape)
            assert got["QKV and fc1 inputs"] == 4 * s * b * h
            assert sum(got.values()) == 4 * s * b * h + (30 * s * b * h + 5 * a * s * s * b) // t


def test_minitron_closed_forms_of_lesson_03():
    # Lesson 03's hand count: float32 everything, LayerNorm statistics, a bool causal mask.
    for b, s, h, a in ((2, 16, 32, 8), (3, 24, 48, 4)):
        for t in (1, 2, 4):
            tp = 4 * (b * s * h * (6 + 12 // t) + 3 * a * s * s * b // t + 4 * b * s) + s * s
            assert layer_bytes(b, s, h, a, t, precision=MINITRON) == tp
            if t > 1:
                sp = 4 * (b * s * h * (2 + 16 // t) + 3 * a * s * s * b // t + 4 * b * s // t) + s * s
                assert layer_bytes(b, s, h, a, t, sp=True, precision=MINITRON) == sp


def test_recompute_removes_what_it_recomputes():
    shape = SHAPES[1]
    none = layer_terms(t=4, sp=True, regather=True, **shape)
    selective = layer_terms(t=4, sp=True, regather=True, recompute="selective", **shape)
    assert set(none) - set(selective) == {"attention scores"}
    assert layer_terms(t=4, sp=True, recompute="full", **shape) == {"layer input": 2 * 512 * 4 * 1024 // 4}


@pytest.mark.parametrize("kwargs, message", [
    (dict(b=0, s=16, h=32, a=8), "b must be a positive integer, got 0"),
    (dict(b=1, s=16, h=30, a=8), "hidden h=30 is not divisible by the number of heads a=8"),
    (dict(b=1, s=16, h=32, a=8, t=3), "choose t dividing 8"),
    (dict(b=1, s=12, h=32, a=8, t=8, sp=True), "choose s a multiple of 8"),
    (dict(b=1, s=16, h=32, a=8, t=2, regather=True), "pass sp=True or regather=False"),
    (dict(b=1, s=16, h=32, a=8, recompute="some"), "recompute='some': choose one of"),
])
def test_bad_input_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        layer_bytes(**kwargs)


# ---- against the measurement (the same as lesson 03's section 6) --------------------------
CFG = ModelConfig(vocab_size=64, seq_len=16, hidden=32, n_layers=1, n_heads=8, dropout=0.1)
B = 2


def _saved_bytes(sp):
    """Bytes of the distinct non-parameter storages block 0 saves for backward on this rank."""
    grid = build_grid(ParallelConfig(tp=dist.get_world_size(), sequence_parallel=sp))
    model = ParallelGPT(CFG, grid, seed=0).train()
    s_local = CFG.seq_len // grid.tp.size if sp else CFG.seq_len
    x = torch.randn(B, s_local, CFG.hidden, requires_grad=True)
    with saved_bytes(exclude=model.parameters()) as saved:
        model.layers[0](x, model.rng)
    return saved.bytes


def _mismatches(measured: dict, predict) -> list[str]:
    return [f"t={t} sp={sp}: measured {m} bytes, formula {predict(t, sp)} bytes"
            for (t, sp), m in measured.items() if m != predict(t, sp)]


@pytest.fixture(scope="module")
def measured(run_ranks):
    out = {}
    for t, sp in ((1, False), (2, False), (2, True), (4, True)):
        per_rank = run_ranks(_saved_bytes, sp, world_size=t)
        assert len(set(per_rank)) == 1, f"ranks saved different amounts: {per_rank}"
        out[t, sp] = per_rank[0]
    return out


def _minitron(t, sp, regather=False):
    return layer_bytes(B, CFG.seq_len, CFG.hidden, CFG.n_heads, t, sp=sp, regather=regather,
                       precision=MINITRON)


def test_minitron_variant_matches_the_measurement(measured):
    assert _mismatches(measured, _minitron) == []


def test_dividing_every_bsh_term_by_t_is_caught(measured):
    # The planted mistake: SP also divides the gathered matmul inputs (Megatron's re-gather,
    # which minitron does not do). The comparison must name the configurations it gets wrong.
    wrong = _mismatches(measured, lambda t, sp: _minitron(t, sp, regather=sp))
    assert [line.split(":")[0] for line in wrong] == ["t=2 sp=True", "t=4 sp=True"]
    assert re.fullmatch(r"t=2 sp=True: measured \d+ bytes, formula \d+ bytes", wrong[0])
