"""`make grade` compares a learner's answers with the reference, whatever the learner's file holds.

For every exercise, three learner notebooks are graded:
  planted   the solution's answers except one planted wrong answer (tests/planted/NN_*.py), in a
            file whose stored outputs would pass it if the grader believed them. For EXECUTED
            (the cheapest exercise to run) the file is executed and saved WITH ITS OWN OUTPUTS,
            as JupyterLab's autosave leaves it: nbval run on that file alone compares the wrong
            answer's outputs with themselves and passes it. For the others the reference's own
            outputs are pasted in (a copied solution, a stale save): right outputs in the file
            do not make a wrong answer pass either. (That stored outputs play no part at all,
            the graded copy being the same with them cleared, is shown for every exercise.)
  solved    the solution's answers, outputs cleared, and one check cell edited so that it
            would raise if it ran;
  unsolved  the exercise as shipped, outputs cleared, with an IPython input transformer installed
            by its first answer cell that replaces every later check cell with a print of the
            reference's stored output (issue 20 §2): the checks must run all the same, and fail
            on the stub.
against a copy of the solutions whose torch stamp is a version no one has. Solving an exercise
reproduces its solution notebook exactly, so `solved` passing is also the solution's own nbval run.
All of them are graded in two runs of the grader side by side (a run starts nbval once; a
notebook costs a kernel, torch's import and its own cells).
"""
from __future__ import annotations

import copy
import importlib.util
import json
import os
import pathlib
from concurrent.futures import ThreadPoolExecutor

import nbformat
import pytest
from nbclient import NotebookClient

from minitron.grade import cli as grader
from minitron.grade import recorded
from minitron.grade.values import VALUE_MIME
from notebook_files import cleared, save
from preloaded_kernels import unix_sockets

ROOT = pathlib.Path(__file__).resolve().parent.parent
NAMES = sorted(p.name for p in (ROOT / "exercises").glob("*.ipynb"))
PLANTED = ROOT / "tests" / "planted"
OTHER_TORCH = "0.0.1"  # no one has it: the grader must say it differs
EXECUTED = "07_mixed_precision.ipynb"  # the planted notebook run and saved with its own outputs
KINDS = ("planted", "solved", "unsolved")
# Exercises whose check cells still print text (compared as text until they show values with
# minitron.grade.values.show): text a kernel can forge, so an answer cell that replays it passes.
TEXT_CHECKS = {n for n in NAMES if VALUE_MIME not in (ROOT / "solutions" / n).read_text()}


def until_values(names):
    return [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=f"{n}'s checks print text, which "
                                                    "an answer cell can replay: convert them to show()"))
            if n in TEXT_CHECKS else n for n in names]


def planted(name: str):
    path = PLANTED / (pathlib.Path(name).stem + ".py")
    spec = importlib.util.spec_from_file_location(f"planted_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def code_cells(nb: dict) -> list[dict]:
    return [c for c in nb["cells"] if c["cell_type"] == "code"]


def answer_ids(nb: dict) -> list[str]:
    return [c["id"] for c in nb["cells"] if grader.is_answer_cell(c)]


def with_answers(exercise: dict, solution: dict, wrong: dict[str, str]) -> dict:
    """The exercise with the solution's answer cells, except those `wrong` replaces."""
    answers = {c["id"]: grader.source(c) for c in solution["cells"] if grader.is_answer_cell(c)}
    nb = cleared(exercise)
    for cell in nb["cells"]:
        if cell.get("id") in answers:
            cell["source"] = wrong.get(cell["id"], answers[cell["id"]])
    return nb


def first_check_cell(solution: dict) -> dict:
    code = [c for c in solution["cells"] if c["cell_type"] == "code"]
    first_answer = next(k for k, c in enumerate(code) if grader.is_answer_cell(c))
    return next(c for c in code[first_answer:] if not grader.is_answer_cell(c))


REPLAY = """
# Replace each check cell, before IPython compiles it, by a print of its stored output.
_STORED = {stored!r}


def _replay(lines):
    text = "".join(lines)
    for check, output in _STORED.items():
        if check.strip() and check.strip() in text:
            return [f"print({{output!r}}, end='')\\n"]
    return lines


get_ipython().input_transformers_cleanup.append(_replay)
"""


def with_replayed_checks(nb: dict, solution: dict) -> dict:
    """A copy whose first answer cell also installs a transformer printing the stored outputs."""
    stored = {grader.source(c): "".join("".join(o.get("text", "")) for o in c.get("outputs", [])
                                        if o.get("output_type") == "stream")
              for c in code_cells(solution) if not grader.is_answer_cell(c) and c.get("outputs")}
    nb = copy.deepcopy(nb)
    first = next(c for c in nb["cells"] if c.get("id") in answer_ids(solution))
    first["source"] = grader.source(first) + REPLAY.format(stored=stored)
    return nb


def run_and_save(nb: dict, path: pathlib.Path) -> pathlib.Path:
    """Execute top to bottom, errors allowed, and save with the outputs: a learner's Ctrl-S."""
    node = nbformat.reads(json.dumps(nb), as_version=4)  # joins the sources split in lines
    path.parent.mkdir(parents=True, exist_ok=True)
    NotebookClient(node, timeout=600, allow_errors=True, kernel_name="python3", config=unix_sockets(),
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    nbformat.write(node, str(path))
    return path


def with_outputs_of(nb: dict, reference: dict) -> dict:
    """A copy holding, in every code cell, the reference's stored outputs for the same cell id."""
    nb, stored = copy.deepcopy(nb), {c.get("id"): c for c in code_cells(reference)}
    for cell in code_cells(nb):
        ref = stored[cell["id"]]
        cell["outputs"], cell["execution_count"] = copy.deepcopy(ref["outputs"]), ref["execution_count"]
    return nb


def _prepare(name: str, tmp: pathlib.Path) -> dict:
    """The three learner notebooks of one exercise (EXECUTED's planted one still to be run)."""
    solution = json.loads((ROOT / "solutions" / name).read_text())
    exercise = json.loads((ROOT / "exercises" / name).read_text())
    missing = set(answer_ids(solution)) - {c.get("id") for c in exercise["cells"]}
    assert not missing, (f"exercises/{name} lacks the answer cells {sorted(missing)} of "
                         f"solutions/{name}: run tools/make_exercises.py --force")
    wrong = planted(name)
    edited = first_check_cell(solution)
    solved = with_answers(exercise, solution, {})
    next(c for c in solved["cells"] if c.get("id") == edited["id"])["source"] = (
        'raise RuntimeError("the learner\'s edited check cell ran")\n')
    recorded.stamp(save(solution, tmp / "solutions" / name), OTHER_TORCH)
    planted_nb, planted_path = with_answers(exercise, solution, wrong.WRONG), tmp / "planted" / name
    if name != EXECUTED:
        save(with_outputs_of(planted_nb, solution), planted_path)
    return dict(solution=solution, planted=wrong, edited=edited["id"], files={
        "planted": planted_path,
        "solved": save(solved, tmp / "solved" / name),
        "unsolved": save(with_replayed_checks(cleared(exercise), solution), tmp / "unsolved" / name)},
        to_run=planted_nb if name == EXECUTED else None)


def _grade(runs: dict[str, dict], jobs: list[tuple[str, str]], solutions: pathlib.Path) -> None:
    """Grade these (exercise, kind) notebooks in one run of the grader."""
    before = [runs[name]["files"][kind].read_bytes() for name, kind in jobs]
    lines = []
    grades = grader.grade([runs[name]["files"][kind] for name, kind in jobs], solutions=solutions,
                          show=lambda line: (lines.append(line), print(line)))  # shown with -s
    for (name, kind), g, b in zip(jobs, grades, before):
        run = runs[name]
        run.setdefault("grades", {})[kind] = g
        run.setdefault("before", {})[kind] = b
        run.setdefault("output", {})[kind] = lines


def _selected(request) -> list[str]:
    """The exercises that the selected tests of this module ask about (all, unless -k narrows)."""
    return sorted({item.callspec.params["name"] for item in request.session.items
                   if item.module is request.module and "graded" in item.fixturenames
                   and "name" in getattr(getattr(item, "callspec", None), "params", {})})


# The solutions' stored outputs were recorded natively; the grader's runs use torch's kernels
# without vector instructions (as tests/test_notebooks.py runs the lessons), so a check whose
# output depends on the CPU's summation order fails here first, not on a learner's machine.
CPU_CAPABILITY = os.environ.get("MINITRON_TEST_CPU_CAPABILITY", "default")


@pytest.fixture(scope="module")
def graded(request, tmp_path_factory):
    """name -> its three graded notebooks. Two runs of the grader, one per core, take the
    notebooks alternately (half of every kind each); the one in a thread starts at once,
    the main thread's once EXECUTED's planted notebook has been executed and saved."""
    if CPU_CAPABILITY != "native":       # nbval's process, its kernels and their ranks inherit it
        monkeypatch = pytest.MonkeyPatch()
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", CPU_CAPABILITY)
        request.addfinalizer(monkeypatch.undo)
    tmp = tmp_path_factory.mktemp("grading")
    runs = {name: _prepare(name, tmp) for name in _selected(request)}
    jobs = [(name, kind) for name in runs for kind in KINDS]
    mine, other = jobs[0::2], jobs[1::2]
    if (EXECUTED, "planted") in other:
        mine, other = other, mine
    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(_grade, runs, other, tmp / "solutions")
        for run in runs.values():
            if run["to_run"] is not None:
                run_and_save(run["to_run"], run["files"]["planted"])
        _grade(runs, mine, tmp / "solutions")
        done.result()
    return runs.__getitem__


def test_every_exercise_has_a_planted_wrong_answer():
    assert NAMES, "no exercises found"
    missing = [n for n in NAMES if not (PLANTED / (pathlib.Path(n).stem + ".py")).exists()]
    assert not missing, f"no planted wrong answer for {missing}: add tests/planted/<name>.py " \
                        "(format: tests/planted/README.md)"
    assert EXECUTED in NAMES, f"EXECUTED = {EXECUTED!r} is no exercise: name the cheapest one"


@pytest.mark.parametrize("name", NAMES)
def test_planted_answer_is_a_wrong_version_of_an_answer_cell(name):
    solution = json.loads((ROOT / "solutions" / name).read_text())
    answers = {c["id"]: grader.source(c) for c in solution["cells"] if grader.is_answer_cell(c)}
    wrong = planted(name)
    assert wrong.WRONG and isinstance(wrong.FAILS_AT, str) and wrong.FAILS_AT
    for cell_id, text in wrong.WRONG.items():
        assert cell_id in answers, f"tests/planted: {cell_id} is not an answer cell of solutions/{name}"
        assert text != answers[cell_id], f"tests/planted: {cell_id} is the solution itself"


@pytest.mark.parametrize("name", NAMES)
def test_saved_wrong_answer_fails_at_its_check(name, graded):
    run = graded(name)
    g, fails_at = run["grades"]["planted"], run["planted"].FAILS_AT
    assert not g.passed, "a saved wrong answer passes grading:\n" + "\n".join(run["output"]["planted"])
    assert f"FAIL at {fails_at}" in g.summary, g.summary
    assert not g.failures[0].stub, g.summary
    assert g.summary in run["output"]["planted"]
    # the premise: at that check the file holds outputs that a grader believing them would pass
    n = g.failures[0].cell
    saved = code_cells(json.loads(run["files"]["planted"].read_text()))[n]["outputs"]
    reference = code_cells(run["solution"])[n]["outputs"]
    if name == EXECUTED:  # its own: nbval alone compared the file with itself, and passed it
        assert saved and saved != reference
    else:                 # the reference's own
        assert saved == reference


@pytest.mark.parametrize("name", NAMES)
def test_solution_answers_pass_whatever_the_check_cells_and_outputs(name, graded):
    run = graded(name)
    g = run["grades"]["solved"]
    assert g.passed, "\n".join(run["output"]["solved"])
    assert g.summary.endswith(f"PASS ({g.checked} checked cells reproduce the reference)") and g.checked
    edited = [n for n in g.notes if n.startswith("you edited a check cell")]
    assert len(edited) == 1 and f"id {run['edited']}" in edited[0] and "the reference's is used" in edited[0]


@pytest.mark.parametrize("name", until_values(NAMES))
def test_unsolved_exercise_fails_on_its_stub(name, graded):
    # Its first answer cell installed a transformer replacing each later check by a print of the
    # check's stored text: a check that prints its verdict raises on the stub all the same; one
    # that shows values (minitron.grade.values) then shows none, and fails for that.
    run = graded(name)
    g = run["grades"]["unsolved"]
    assert not g.passed
    first = g.failures[0]
    assert not first.where.startswith("your answer cell"), g.summary
    if first.kind == "value":
        assert first.message.startswith("it showed 0 of its"), g.summary
        return
    assert first.kind == "exception" and (first.exception, first.message) == (
        "NotImplementedError", "your code here"), g.summary
    assert first.yours, f"the stub raised in {first.raised_in!r}, not in a function of an answer cell"
    assert "is not written yet (its stub raised NotImplementedError)" in g.summary


@pytest.mark.parametrize("name", NAMES)
def test_cleared_outputs_do_not_change_what_is_graded(name, graded):
    run = graded(name)
    saved = json.loads(run["files"]["planted"].read_text())
    assert any(c.get("outputs") for c in saved["cells"])
    assert grader.merge(saved, run["solution"]) == grader.merge(cleared(saved), run["solution"])


@pytest.mark.parametrize("name", NAMES)
def test_learner_files_are_not_touched(name, graded):
    run = graded(name)
    assert {k: p.read_bytes() for k, p in run["files"].items()} == run["before"]
    for path in run["files"].values():  # and nothing was written beside them
        assert {p.name for p in path.parent.iterdir()} <= set(NAMES), list(path.parent.iterdir())


@pytest.mark.parametrize("name", NAMES)
def test_another_torch_is_said_once_before_the_results(name, graded):
    for kind, lines in graded(name)["output"].items():
        said = [k for k, line in enumerate(lines) if f"recorded with torch {OTHER_TORCH}" in line]
        assert said == [0], (kind, lines)


def test_every_solution_records_its_torch_version():
    unstamped = [n for n in NAMES
                 if not recorded.recorded_torch(json.loads((ROOT / "solutions" / n).read_text()))]
    assert not unstamped, (f"{unstamped} do not record the torch their outputs were made with: after "
                           "re-executing, run python -m minitron.grade --stamp solutions/*.ipynb")
