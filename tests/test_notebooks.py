"""The course itself is tested: every lesson passes nbval (its stored outputs are reproduced
exactly), every exercise is generated from its solution, and the generator refuses markers
that would leak a solution. Grading (tests/test_grading.py) runs every solution's answers in
its reference notebook, which is the solution's own nbval run, and shows that every unsolved
exercise fails because of its stubs."""
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


@pytest.mark.parametrize("path", LESSONS, ids=_id)
def test_notebook_reproduces_its_outputs(path):
    result = nbval(path)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


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


def _make_exercises(tmp_path, cells_source: list[str], *flags: str) -> subprocess.CompletedProcess:
    """make_exercises.py on one solution notebook with these code cells, in tmp_path."""
    (tmp_path / "s").mkdir(exist_ok=True)
    (tmp_path / "e").mkdir(exist_ok=True)
    cells = [{"cell_type": "code", "id": f"c{k}", "metadata": {}, "execution_count": None,
              "outputs": [], "source": src} for k, src in enumerate(cells_source)]
    nb = {"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    (tmp_path / "s" / "07_demo.ipynb").write_text(json.dumps(nb))
    return subprocess.run([sys.executable, "tools/make_exercises.py", "--solutions", str(tmp_path / "s"),
                           "--exercises", str(tmp_path / "e"), *flags],
                          cwd=ROOT, capture_output=True, text=True)


GOOD = "def f():\n    # BEGIN SOLUTION\n    return 1\n    # END SOLUTION\n"


@pytest.mark.parametrize("bad, says", [
    ("def g():\n    # BEGIN SOLUTION\n    return 2\n", "'# BEGIN SOLUTION' at line 2 is never closed"),
    ("def g():\n    return 2\n    # END SOLUTION\n", "line 3: '# END SOLUTION' without a '# BEGIN SOLUTION'"),
    ("# BEGIN SOLUTION\n# BEGIN SOLUTION\nx = 1\n# END SOLUTION\n", "line 2: '# BEGIN SOLUTION' inside the block"),
    ("x = 1  # BEGIN SOLUTION\ny = 2\n# END SOLUTION\n", "line 1 holds a marker and code"),
])
@pytest.mark.parametrize("flags", [(), ("--check",), ("--force",)], ids=["write", "check", "force"])
def test_unpaired_solution_markers_are_refused(tmp_path, bad, says, flags):
    result = _make_exercises(tmp_path, [GOOD, bad], *flags)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"07_demo.ipynb, cell 1 (id c1): {says}" in result.stderr, result.stderr
    assert "the solution would leak into the exercise" in result.stderr
    assert not (tmp_path / "e" / "07_demo.ipynb").exists()


def test_exercise_is_stubbed_and_a_learners_copy_is_kept(tmp_path):
    assert _make_exercises(tmp_path, [GOOD]).returncode == 0
    exercise = tmp_path / "e" / "07_demo.ipynb"
    src = "".join(json.loads(exercise.read_text())["cells"][0]["source"])
    assert src == 'def f():\n    raise NotImplementedError("your code here")\n'
    assert _make_exercises(tmp_path, [GOOD], "--check").returncode == 0
    exercise.write_text(exercise.read_text().replace("your code here", "return 1"))  # the learner's work
    learner = exercise.read_bytes()
    kept = _make_exercises(tmp_path, [GOOD])
    assert kept.returncode == 0 and "kept" in kept.stdout and exercise.read_bytes() == learner
    assert _make_exercises(tmp_path, [GOOD], "--check").returncode == 1
    assert _make_exercises(tmp_path, [GOOD], "--force").returncode == 0 and exercise.read_bytes() != learner
