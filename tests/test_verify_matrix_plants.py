"""The tests of the matrix's tests: each dimension's planted bug fails exactly its rows.
Apart from tests/test_verify_matrix.py so that, with `make test`'s whole files per worker
(--dist loadfile), the two quick matrices of the plants and the clean one run on two workers."""
import pytest

from minitron.verify import matrix
from minitron.verify import cli as verify_cli


@pytest.mark.parametrize("plant", ["dp-bucket", "cp-no-rescale"])
def test_a_planted_bug_fails_exactly_the_rows_of_its_dimension(capsys, plant):
    assert verify_cli.main(["--matrix", "--quick", "--plant", plant]) == 0
    out = capsys.readouterr().out
    dim = matrix.PLANT_DIMENSION[plant]
    assert f"plant {plant}: the rows with {dim} FAIL and the others PASS" in out, out
    assert " FAIL " in out
