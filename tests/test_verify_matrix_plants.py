"""The tests of the matrix's tests: each dimension's planted bug fails exactly its rows.
Apart from tests/test_verify_matrix.py so that, with `make test`'s whole files per worker
(--dist loadfile), the two quick matrices of the plants and the clean one run on two workers.

Every quick row that holds the plant's dimension runs planted and must FAIL. Of the rows
without it, which test_the_quick_matrix_passes runs clean already, two run here: the first row
(one device, before any planted row) and the last (pp2 x ep2, after all of them, so a plant
left installed by an earlier row would fail it). The other clean rows would be the same clean
runs again (dp-bucket: 8 of 21 rows, cp-no-rescale: 16 of 21).

Each row takes one step (--steps 1), not the clean matrix's two: both plants are caught in the
first step's gradients, so a second step would only repeat the catch (the clean rows' two steps
are test_the_quick_matrix_passes's). The file's CPU: 128 s -> 72 s (/usr/bin/time, 2 shared cores)."""
import pytest

from minitron.verify import matrix
from minitron.verify import cli as verify_cli

QUICK = matrix.cases


def planted_and_bracketing_rows(dim: str) -> list[matrix.Case]:
    rows = QUICK(quick=True)
    assert rows[0].world == 1 and rows[-1].sizes[dim] == 1, "the bracketing rows moved: choose again"
    return [rows[0]] + [c for c in rows if c.sizes[dim] > 1] + [rows[-1]]


@pytest.mark.parametrize("plant", ["dp-bucket", "cp-no-rescale"])
def test_a_planted_bug_fails_exactly_the_rows_of_its_dimension(capsys, monkeypatch, plant):
    dim = matrix.PLANT_DIMENSION[plant]
    rows = planted_and_bracketing_rows(dim)
    monkeypatch.setattr(matrix, "cases", lambda quick=False: rows)
    assert verify_cli.main(["--matrix", "--quick", "--plant", plant, "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert f"plant {plant}: the rows with {dim} FAIL and the others PASS" in out, out
    verdicts = [line.split(": ")[-1] for line in out.splitlines() if line.startswith("  ")][:len(rows)]
    # refused: a combination the engine does not run with the plant's setting (HSDP at ZeRO 0)
    assert verdicts[0] == verdicts[-1] == "PASS" and set(verdicts[1:-1]) <= {"FAIL", "refused"}, out
    assert verdicts.count("FAIL") >= len(rows) - 3, out
