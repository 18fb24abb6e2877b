"""The grader's parts on small inputs: the reason it gives for a failure (read from the
tracebacks nbval records), its command line on a course of one tiny exercise, and the stamp."""
from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest

from minitron.grade import cli as grader
from minitron.grade import recorded
from minitron.grade import report
from notebook_files import cleared, save
from minitron.grade.report import root_exception
from minitron.grade.values import VALUE_MIME

ROOT = pathlib.Path(__file__).resolve().parent.parent


# --- the reasons in words, on tracebacks as nbval records them ------------------------------

RANK_ERROR = """RankError: rank 0 raised:
Traceback (most recent call last):
  File "/work/main/minitron/runtime/launch.py", line 178, in _child_main
    payload = ("ok", fn(*args, **kwargs))
  File "/tmp/ipykernel_1/2.py", line 3, in ring_all_reduce
    raise NotImplementedError("your code here")
NotImplementedError: your code here

The other ranks were stopped while doing:
  rank 1: running"""

TRITON = ["NotImplementedError                       Traceback (most recent call last)",
          "File /x/triton/runtime/interpreter.py:1511, in GridExecutor.__call__(self)\n-> 1511  self.fn(**args)\n",
          "Cell In[1], line 3, in rmsnorm_fwd(X, W)\n----> 3     raise NotImplementedError(\"your code here\")\n",
          "NotImplementedError: your code here",
          "\nThe above exception was the direct cause of the following exception:\n",
          "InterpreterError                          Traceback (most recent call last)",
          "Cell In[1], line 13\n---> 13 y, rstd = check(x, w)\n",
          "InterpreterError: NotImplementedError('your code here')"]


@pytest.mark.parametrize("ename, evalue, tb, expected", [
    ("RankError", "rank 0 raised: ...", ["RankError  Traceback (most recent call last)", RANK_ERROR],
     ("NotImplementedError", "your code here", "ring_all_reduce", 3)),
    ("InterpreterError", "NotImplementedError('your code here')", TRITON,
     ("NotImplementedError", "your code here", "rmsnorm_fwd", 3)),
    ("SyntaxError", "incomplete input (1.py, line 2)", ["  Cell In[1], line 2\n    def f(\n", "SyntaxError: x"],
     ("SyntaxError", "incomplete input (1.py, line 2)", "", 0)),
    ("ValueError", "shapes differ", ["ValueError  Traceback (most recent call last)",
                                     "Cell In[2], line 4, in check(a)\n      4 raise ValueError('x')\n",
                                     "ValueError: shapes differ"], ("ValueError", "shapes differ", "check", 4)),
])
def test_root_exception_is_found_through_ranks_and_triton(ename, evalue, tb, expected):
    assert root_exception(ename, evalue, tb) == expected


# --- the command line, on a tiny course of one exercise (fast: one short kernel per notebook) ---

def _cell(kind: str, src: str, cell_id: str, out: str | None = None, shown: dict | None = None) -> dict:
    if kind == "markdown":
        return {"cell_type": "markdown", "id": cell_id, "metadata": {}, "source": src}
    outputs = [{"name": "stdout", "output_type": "stream", "text": out}] if out else []
    outputs += [{"output_type": "display_data", "metadata": {}, "data": {  # what show() stores
        "text/plain": f"{label}: {value}", VALUE_MIME: {"label": label, "value": value, "rtol": 1e-5, "atol": 1e-8}}}
        for label, value in (shown or {}).items()]
    return {"cell_type": "code", "id": cell_id, "metadata": {}, "execution_count": 1,
            "outputs": outputs, "source": src}


DEMO_ANSWER = "def double(v):\n    # BEGIN SOLUTION\n    return 2 * v\n    # END SOLUTION\n"
DEMO = {"cells": [
    _cell("code", "import math\nfrom minitron.grade.values import show\nx = 21\n", "setup"),
    _cell("markdown", "## Part 1 · `double`\n", "m1"),
    _cell("code", DEMO_ANSWER, "answer"),
    _cell("markdown", "### Check 1: doubling 21 and -4\n", "m2"),
    _cell("code", 'def check_double():\n    return double(x)\n'
                  'show("double(21)", check_double())\nshow("double(-4)", double(-4))\n', "check",
          shown={"double(21)": 42, "double(-4)": -8}),
], "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
   "nbformat": 4, "nbformat_minor": 5}


def _learner(folder: pathlib.Path, answer: str | None, extra: str | None = None) -> pathlib.Path:
    nb = cleared(DEMO)
    cells = nb["cells"]
    if answer is None:
        cells.remove(next(c for c in cells if c["id"] == "answer"))
    else:
        next(c for c in cells if c["id"] == "answer")["source"] = answer
    if extra:
        cells.append(_cell("code", extra, "scratch"))
    return save(nb, folder / "07_demo.ipynb")


def test_command_line_on_a_tiny_course(tmp_path):
    save(DEMO, tmp_path / "solutions" / "07_demo.ipynb")  # no torch stamp: nothing to say about it
    right = _learner(tmp_path / "right",
                     'def double(v):\n    return v + v\n\nprint("what an answer cell prints is not graded")\n',
                     extra="print('my scratch')\n")
    missing = _learner(tmp_path / "missing", None)
    wrong = _learner(tmp_path / "wrong", "def double(v):\n    return [v, v][2]\n")
    broken = tmp_path / "broken" / "07_demo.ipynb"
    broken.parent.mkdir()
    broken.write_text("{ not json")
    result = subprocess.run([sys.executable, "-m", "minitron.grade", "--solutions",
                             str(tmp_path / "solutions"), str(right), str(missing), str(wrong), str(broken)],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    lines = result.stdout.splitlines()
    assert result.returncode == 1, result.stdout + result.stderr
    assert not any("torch" in line for line in lines), lines
    assert lines[-4:] == [
        f"{right}: PASS (1 checked cells reproduce the reference)",
        f"{missing}: FAIL at your answer cell under 'Part 1 · `double`': it raised NotImplementedError: "
        "your notebook has no answer cell answer: nothing to grade (1 later cell fails too)",
        f"{wrong}: FAIL at Check 1: doubling 21 and -4: "
        "your double raised IndexError: list index out of range",
        f"{broken}: FAIL: could not read it as a notebook (Expecting property name enclosed in double "
        "quotes: line 1 column 3 (char 2))"], result.stdout
    assert f"{right}: your cell scratch (\"print('my scratch')\") is not part of the exercise: not run" in lines
    assert (f"{missing}: your notebook has no answer cell answer (the answer cell under "
            "'Part 1 · `double`'): graded as unsolved") in lines


def test_stamp_records_the_torch_version_and_nothing_else(tmp_path):
    path = save(DEMO, tmp_path / "07_demo.ipynb")
    assert grader.main(["--stamp", "--torch", "2.99.0", str(path)]) == 0
    stamped = json.loads(path.read_text())
    assert recorded.recorded_torch(stamped) == "2.99.0"
    assert stamped["metadata"].pop("minitron") == {"recorded_with": {"torch": "2.99.0"}}
    assert stamped == DEMO
    recorded.stamp(path)
    assert recorded.recorded_torch(json.loads(path.read_text())) == recorded.torch_version()
    assert recorded.torch_line({path: json.loads(path.read_text())}) is None


# --- names and counts of the real exercises' cells (issue 20 §5) -----------------------------

def _solution(name: str) -> dict:
    return json.loads(next((ROOT / "solutions").glob(name + "_*.ipynb")).read_text())


@pytest.mark.parametrize("number", sorted(p.name[:2] for p in (ROOT / "solutions").glob("*.ipynb")))
def test_checks_are_named_by_what_they_check(number):
    nb = _solution(number)
    names = report.cell_names(nb)
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    for cell, name in zip(code, names):
        assert not re.search(r"\((check\w*|counted|block|scores|saved_bytes)\)", name), name
        if cell.get("outputs") and not report.is_answer_cell(cell) and name.startswith("Check"):
            assert re.fullmatch(r"Check \w+: .{8,}", name), name  # a bare "Check 1" says what it checks


def test_a_cell_below_a_check_is_not_named_after_it():
    names = report.cell_names(_solution("06"))
    assert names[2] == "Check 1: measured on two real ranks, and at scale", names
    # the answer cell below Check 1 is named after its own heading, not after the check
    assert names[3] == "your answer cell under 'Part 2: what each group sends, over $m$ micro-batches'", names


def test_no_exercise_speaks_of_lines_that_raise():
    # issue 20: an exercise once said "between the lines that raise"; a stub is one line
    for number in sorted(p.name[:2] for p in (ROOT / "solutions").glob("*.ipynb")):
        text = "".join(grader.source(c) for c in _solution(number)["cells"] if c["cell_type"] == "markdown")
        assert "between the lines that raise" not in text, number


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_kernel_that_dies_starting_is_started_once_more(tmp_path, monkeypatch):
    """Under load a kernel can die before it answers (the last CI run: 'Kernel died before
    replying to kernel_info'); the second start must find its throwaway folder reusable.
    No heartbeat thread is started: one stopped this early reopened its socket until zmq ran
    out ("Too many open files" in a thread of this test, in one suite run of about a dozen)."""
    from jupyter_client.blocking.client import BlockingKernelClient
    from jupyter_client.channels import HBChannel
    beats = []
    monkeypatch.setattr(HBChannel, "start", lambda self: beats.append(self))
    real, calls = BlockingKernelClient.wait_for_ready, []

    def dies_once(self, timeout=None):
        calls.append(timeout)
        if len(calls) == 1:
            raise RuntimeError("Kernel died before replying to kernel_info")
        return real(self, timeout=timeout)

    monkeypatch.setattr(BlockingKernelClient, "wait_for_ready", dies_once)
    save(DEMO, tmp_path / "solutions" / "07_demo.ipynb")
    right = _learner(tmp_path / "right", "def double(v):\n    return 2 * v\n")
    lines = []
    [g] = grader.grade([right], solutions=tmp_path / "solutions", show=lines.append)
    assert len(calls) == 2 and g.passed, lines
    assert not beats, "a heartbeat thread was started"


def test_a_fork_server_a_kernel_ended_leaves_no_folder(tmp_path):
    """A kernel that kills the fork server (test_grading_tamper.py does) ends the grading; the
    server's folder (its Python link, its compile caches) goes with it, not only at exit: the
    exit closes the servers still listed, and check() unlists a dead one."""
    from minitron.grade import forkserver
    home = tmp_path / "minitron-forkserver-test"
    home.mkdir()
    server = forkserver.ForkServer([], sys.executable, {"PATH": "/usr/bin:/bin"}, home, preload=())
    key = ("test", str(home))
    forkserver._servers[key] = server
    server.proc.kill()
    server.proc.wait()
    with pytest.raises(forkserver.ForkServerGone):
        server.check()
    assert key not in forkserver._servers
    assert not home.exists()
