"""The course itself is tested: every lesson passes nbval (its stored outputs are reproduced
exactly), every exercise is generated from its solution, and the generator refuses markers
that would leak a solution. Grading (tests/test_grading.py) runs every solution's answers in
its reference notebook, which is the solution's own nbval run, and shows that every unsolved
exercise fails because of its stubs.

The lessons run in RUNS nbval processes side by side (alternate lessons each), not one per
lesson: a process pays once for pytest and nbformat's import, a lesson for its own kernel,
torch's import and its cells.

The lessons' outputs are stored from a native run (AVX2 or AVX512 on x86), and nbval runs them
here under ATEN_CPU_CAPABILITY=default, torch's kernels without vector instructions: a sum
taken in another order. A pass therefore means both capabilities print the same, and an
output that depends on the machine (the extreme of a tail, many digits of a sum) fails here
rather than on a learner's CPU. It costs nothing measurable on the lessons' small tensors
(lesson 07: 9.6 s native, 7.9 s default). MINITRON_TEST_CPU_CAPABILITY=native runs them as stored."""
import json
import os
import pathlib
import subprocess
import sys
from xml.etree import ElementTree

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LESSONS = sorted((ROOT / "lessons").glob("*.ipynb"))
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
EXERCISES = sorted((ROOT / "exercises").glob("*.ipynb"))


RUNS = 2   # nbval processes side by side: a lesson's kernel is one process, its ranks several
# the capability the lessons are checked under (module docstring); "native": torch's choice
CPU_CAPABILITY = os.environ.get("MINITRON_TEST_CPU_CAPABILITY", "default")


def _id(p):
    return f"{p.parent.name}/{p.name}"


# pytest, but with rfc3987_syntax hidden from jsonschema (the grader's nbval plugin did so too): at
# import it compiles a grammar for a string format no notebook schema uses (5 s of CPU here);
# and each lesson's kernel forked from one that has imported torch, its channels on Unix sockets
# (tests/preloaded_kernels.py)
NBVAL = (f"import sys, pytest; sys.modules.setdefault('rfc3987_syntax', None); "
         f"sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r}); "
         "import preloaded_kernels; preloaded_kernels.install(); "
         "sys.exit(pytest.main(sys.argv[1:], plugins=[preloaded_kernels]))")


def _nbval_env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if CPU_CAPABILITY != "native":
        env["ATEN_CPU_CAPABILITY"] = CPU_CAPABILITY   # the kernel and its ranks inherit it
    return env


def _start_nbval(paths: list[pathlib.Path], junit: pathlib.Path) -> subprocess.Popen:
    # One torch thread in each kernel, as launch gives each rank: on tensors this small a
    # second thread only waits at every op's barrier, for a core that another process holds
    # (a lesson's 40 training steps took 12 s of CPU with two threads, 0.5 s with one).
    return subprocess.Popen(
        [sys.executable, "-c", NBVAL, "--nbval", "-p", "no:cacheprovider", "-q", "--color=no",
         "--nbval-cell-timeout=600", f"--junitxml={junit}", *map(str, paths)],
        cwd=ROOT, env=_nbval_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _failures_by_notebook(junit: pathlib.Path, paths: list[pathlib.Path]) -> dict:
    """{path: [failure texts]} of the cells nbval ran; a notebook with no cells run is absent."""
    out: dict = {}
    for case in ElementTree.parse(junit).iter("testcase"):
        path = next((p for p in paths if case.get("classname", "").endswith(p.name)), None)
        if path is not None:
            out.setdefault(path, []).extend(
                f"{case.get('name')}: {bad.text or bad.get('message', '')}"
                for bad in case if bad.tag in ("failure", "error"))
    return out


@pytest.fixture(scope="module")
def lesson_failures(request, tmp_path_factory):
    """path -> (failure texts or None when nbval did not run it, nbval's output), for the
    lessons the selected tests ask about, from RUNS nbval processes side by side."""
    paths = sorted({item.callspec.params["path"] for item in request.session.items
                    if item.module is request.module and "lesson_failures" in item.fixturenames})
    tmp = tmp_path_factory.mktemp("nbval")
    runs = [(paths[k::RUNS], tmp / f"run{k}.xml") for k in range(min(RUNS, len(paths)))]
    procs = [_start_nbval(mine, junit) for mine, junit in runs]
    results = {}
    try:
        for (mine, junit), proc in zip(runs, procs):
            output = proc.communicate(timeout=1200 * len(mine))[0]
            found = _failures_by_notebook(junit, mine) if junit.exists() else {}
            results.update({p: (found.get(p), output) for p in mine})
    finally:
        for proc in procs:
            proc.kill()
    return results


@pytest.mark.parametrize("path", LESSONS, ids=_id)
def test_notebook_reproduces_its_outputs(path, lesson_failures):
    failures, output = lesson_failures[path]
    assert failures is not None, f"nbval did not run {path.name}:\n{output[-6000:]}"
    assert not failures, "\n".join(failures)[-8000:]


@pytest.mark.skipif(CPU_CAPABILITY == "native", reason="lessons checked as stored")
def test_lessons_run_under_the_second_cpu_capability():
    """The environment nbval gets really switches torch's kernels (a misspelt capability
    would be ignored by torch with a warning, and the lessons would run natively)."""
    probe = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    done = subprocess.run([sys.executable, "-c", probe], env=_nbval_env(), capture_output=True, text=True)
    assert done.stdout.strip() == CPU_CAPABILITY.upper(), done.stdout + done.stderr


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


def test_exercise_drops_the_outputs_of_check_cells_only(tmp_path):
    """A check cell's stored outputs are the values the learner is asked to compute: the
    exercise must not carry them; a figure drawn with plt.show() stays."""
    cells = [GOOD, 'show("the answer", f())\n', "import matplotlib.pyplot as plt\nplt.show()\n"]
    assert _make_exercises(tmp_path, cells).returncode == 0
    solution = json.loads((tmp_path / "s" / "07_demo.ipynb").read_text())
    for cell in solution["cells"]:
        cell["outputs"], cell["execution_count"] = [{"output_type": "stream", "name": "stdout", "text": ["1"]}], 1
    (tmp_path / "s" / "07_demo.ipynb").write_text(json.dumps(solution))
    rerun = subprocess.run([sys.executable, "tools/make_exercises.py", "--solutions", str(tmp_path / "s"),
                            "--exercises", str(tmp_path / "e"), "--force"], cwd=ROOT, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr
    check, figure = json.loads((tmp_path / "e" / "07_demo.ipynb").read_text())["cells"][1:]
    assert check["outputs"] == [] and check["execution_count"] is None
    assert figure["outputs"] and figure["execution_count"] == 1


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
