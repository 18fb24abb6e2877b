"""The course itself is tested: every lesson and every solution passes nbval (its stored
outputs are reproduced exactly), and every unsolved exercise fails its grading because of
its stubs, not for another reason."""
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LESSONS = sorted((ROOT / "lessons").glob("*.ipynb"))
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
EXERCISES = sorted((ROOT / "exercises").glob("*.ipynb"))


def nbval(path: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "--nbval", "-p", "no:cacheprovider", "-q",
         "--nbval-cell-timeout=600", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=1200)


def _id(p):
    return f"{p.parent.name}/{p.name}"


@pytest.mark.parametrize("path", LESSONS + SOLUTIONS, ids=_id)
def test_notebook_reproduces_its_outputs(path):
    result = nbval(path)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


@pytest.mark.parametrize("path", EXERCISES, ids=_id)
def test_unsolved_exercise_fails_grading(path):
    result = nbval(path)
    assert result.returncode != 0, f"{path.name} passes its grading with nothing solved"
    assert "NotImplementedError" in result.stdout, (
        f"{path.name} fails, but not because of its stubs:\n" + result.stdout[-4000:])


def test_every_lesson_has_an_exercise_and_a_solution():
    names = {p.name for p in LESSONS}
    assert names, "no lessons found"
    assert names == {p.name for p in SOLUTIONS} == {p.name for p in EXERCISES}


def test_exercises_are_generated_from_their_solutions():
    result = subprocess.run([sys.executable, "tools/make_exercises.py", "--check"],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("path", LESSONS + SOLUTIONS, ids=_id)
def test_notebook_is_saved_executed(path):
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code" and "".join(c["source"]).strip()]
    assert code and all(c.get("execution_count") for c in code), \
        f"{path.name} has unexecuted code cells: nbval would have nothing to compare"
