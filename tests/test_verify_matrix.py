"""python -m minitron.verify --matrix --quick: every dimension at once, row by row, against one
device (its planted bugs: tests/test_verify_matrix_plants.py)."""

import os
import types

from minitron.verify import matrix
from minitron.verify import cli as verify_cli


def test_the_matrix_has_every_combination_of_at_most_8_ranks():
    rows = matrix.cases()[:-len(matrix.FEATURES)]
    assert len(rows) == 26 and all(c.world <= 8 for c in rows)
    assert {c.schedule for c in rows if c.sizes["pp"] > 1} == set(matrix.SCHEDULES)
    assert {c.zero for c in rows if c.sizes["dp"] > 1} == set(matrix.ZERO_STAGES)
    assert {c.cp_variant for c in rows if c.sizes["cp"] > 1} == set(matrix.CP_VARIANTS)
    assert any(c.dtype != matrix.torch.float32 for c in rows)
    quick = matrix.cases(quick=True)[:-len(matrix.FEATURES)]
    assert [c.label() for c in quick] == [c.label() for c in rows if c.sizes in [q.sizes for q in quick]]


def test_every_feature_has_a_row_composed_with_other_dimensions():
    features = matrix.cases()[-len(matrix.FEATURES):]
    assert features == matrix.cases(quick=True)[-len(matrix.FEATURES):]
    labels = " | ".join(c.label() for c in features)
    for name in ("hsdp", "hierarchical a2a2", "tp-overlap", "fp8-delayed", "fp8-current", "dualpipev",
                 "recompute-full", "recompute-selective", "kernels", "fp8-blockwise", "fp8-mxfp8",
                 "moe fp8-current", "aux-free", "max-nodes 1", "ep2 dualpipev moe"):
        assert name in labels, (name, labels)
    # each with at least two dimensions split, on at most 8 ranks
    assert all(sum(v > 1 for v in c.sizes.values()) >= 2 and c.world <= 8 for c in features)


def test_the_matrix_takes_the_model_options_and_says_so(capsys, monkeypatch):
    seen = []
    monkeypatch.setattr(matrix, "run_case", lambda case, steps, plant, base: seen.append(base) or
                        matrix.Result(case, "PASS", 1, 0.0, 9.0))
    argv = ["--matrix", "--quick", "--vocab", "1002", "--hidden", "200", "--heads", "8",
            "--kv-heads", "2", "--seq", "24"]
    assert verify_cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("model: vocab 1002, seq 24, hidden 200, 4 layers, 8 heads, 2 kv heads"), out
    assert {(b.vocab_size, b.hidden, b.n_heads, b.n_kv_heads, b.seq_len) for b in seen} == {(1002, 200, 8, 2, 24)}


def test_a_row_the_shape_does_not_split_into_says_so():
    case = matrix.features()[4]                                  # tp2+sp cp2: 4 ranks
    base = matrix.dataclasses.replace(matrix.DEFAULT_MODEL, seq_len=6)     # 2 cp ranks need 4 chunks
    result = matrix.run_case(case, base=base)
    assert result.verdict == "no fit" and "seq" in result.why, result.why


def test_the_quick_matrix_passes(capsys):
    assert verify_cli.main(["--matrix", "--quick"]) == 0
    out = capsys.readouterr().out
    n = 7 + len(matrix.FEATURES)
    assert f"{n} configurations: {n} PASS, 0 FAIL, 0 refused" in out, out


def test_only_the_kernels_rows_run_under_the_interpreter(monkeypatch):
    """enable_kernels sets TRITON_INTERPRET=1 for a kernels row's ranks; a row after it that
    inherited it would step its optimizer through the interpreter (ops.fused_adamw_step reads
    it on every call): the quick matrix took 117 s of CPU with that, 86 s without."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    seen = []

    def fake_verify(pcfg, mcfg, steps, **kwargs):     # what each row's ranks would inherit
        seen.append((mcfg.use_kernels, os.environ.get("TRITON_INTERPRET")))
        return types.SimpleNamespace(rows=[], passed=True, max_rel_err=0.0, verdict=lambda: "")

    monkeypatch.setattr(matrix, "verify", fake_verify)
    matrix.run(quick=True, show=lambda *a, **k: None)
    assert len(seen) == len(matrix.cases(quick=True)) and any(kernels for kernels, _ in seen)
    assert {interpret for kernels, interpret in seen if kernels} == {"1"}
    assert {interpret for kernels, interpret in seen if not kernels} == {None}
    assert "TRITON_INTERPRET" not in os.environ
