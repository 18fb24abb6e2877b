"""python -m minitron.verify --matrix --quick: every dimension at once, row by row, against one
device; and the tests of the tests: each dimension's planted bug fails exactly its rows."""
import pytest

from minitron.verify import matrix
from minitron.verify import cli as verify_cli


def test_the_matrix_has_every_combination_of_at_most_8_ranks():
    rows = matrix.cases()
    assert len(rows) == 26 and all(c.world <= 8 for c in rows)
    assert {c.schedule for c in rows if c.sizes["pp"] > 1} == set(matrix.SCHEDULES)
    assert {c.zero for c in rows if c.sizes["dp"] > 1} == set(matrix.ZERO_STAGES)
    assert {c.cp_variant for c in rows if c.sizes["cp"] > 1} == set(matrix.CP_VARIANTS)
    assert any(c.dtype != matrix.torch.float32 for c in rows)
    quick = matrix.cases(quick=True)
    assert [c.label() for c in quick] == [c.label() for c in rows if c.sizes in [q.sizes for q in quick]]


def test_the_quick_matrix_passes(capsys):
    assert verify_cli.main(["--matrix", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "7 configurations: 7 PASS, 0 FAIL, 0 refused" in out, out


@pytest.mark.parametrize("plant", ["dp-bucket", "cp-no-rescale"])
def test_a_planted_bug_fails_exactly_the_rows_of_its_dimension(capsys, plant):
    assert verify_cli.main(["--matrix", "--quick", "--plant", plant]) == 0
    out = capsys.readouterr().out
    dim = matrix.PLANT_DIMENSION[plant]
    assert f"plant {plant}: the rows with {dim} FAIL and the others PASS" in out, out
    assert " FAIL " in out
