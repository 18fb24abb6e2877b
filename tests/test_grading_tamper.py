"""What an answer cell does to the kernel cannot change a verdict (issue 20), on a tiny course.

The course is test_grade_parts' one exercise: an answer `double(v)` and a check printing
`double(x)` for the set-up's x = 21. Every wrong answer below returns 41 and tampers with the
kernel in one way that, if the grader let it, would make its check print the reference's
"42 True"; each must fail at Check 1. Right answers that reuse the check's names must pass.
All of them are graded in one run of the grader (a kernel each, no torch).
"""
from __future__ import annotations

import json
import os
import pathlib
import time

import pytest

from minitron.grade import cli as grader
from notebook_files import save
from test_grade_parts import DEMO, _learner

WRONG = "def double(v):\n    return 2 * v - 1\n"
TAMPER = {  # name -> an answer cell: a wrong double plus one way to tamper
    "global_print": WRONG + 'import builtins\ndef print(*a, **k):\n'
                            '    builtins.print(*(str(s).replace("41", "42") for s in a), **k)\n',
    "builtins_print": WRONG + 'import builtins\n_p = builtins.print\n'
                              'builtins.print = lambda *a, **k: _p(*(str(s).replace("41", "42") for s in a), **k)\n',
    "sys_stdout": WRONG + 'import sys\nclass Out:\n    def __init__(self, s): self.s = s\n'
                          '    def write(self, t): return self.s.write(t.replace("41", "42"))\n'
                          '    def flush(self): self.s.flush()\n    def __getattr__(self, n): return getattr(self.s, n)\n'
                          'sys.stdout = Out(sys.stdout)\n',
    "input_transformer": WRONG + 'get_ipython().input_transformers_post.append(\n'
                                 '    lambda lines: ["print(\'42 True\')\\n"] if "check_double" in "".join(lines) else lines)\n',
    "cleanup_transformer": WRONG + 'get_ipython().input_transformers_cleanup.insert(0,\n'
                                   '    lambda lines: ["print(\'42 True\')\\n"] if "check_double" in "".join(lines) else lines)\n',
    "transformers_rebound": WRONG + 'ip = get_ipython()\n'
                                    'ip.input_transformers_post = [\n'
                                    '    lambda lines: ["print(\'42 True\')\\n"] if "check_double" in "".join(lines) else lines]\n'
                                    'ip.input_transformer_manager.cleanup_transforms = list(ip.input_transformers_cleanup)\n',
    "ast_transformer": WRONG + 'import ast\nclass T(ast.NodeTransformer):\n'
                               '    def visit_Module(self, node):\n'
                               '        if "check_double" in ast.dump(node):\n'
                               '            return ast.parse("print(\'42 True\')")\n'
                               '        return node\n'
                               'get_ipython().ast_transformers.append(T())\n',
    "pre_run_cell": WRONG + 'import sys\ndef swap(info):\n'
                            '    sys.modules["__main__"].__dict__["double"] = lambda v: 2 * v\n'
                            '    get_ipython().user_ns["double"] = lambda v: 2 * v\n'
                            'get_ipython().events.register("pre_run_cell", swap)\n',
    "rebound_setup": "x = 21.5\ndef double(v):\n    return int(2 * v) - 1\n",   # 41 from the set-up's 21
}
RIGHT = {  # a right answer whose own names collide with the check's: must pass
    "own_x": "x = 5\ndef double(v):\n    return 2 * v\n",
    "own_check_helper": "def check_double():\n    return 'mine'\ndef double(v):\n    return v + v\n",
    "own_print": "import builtins\ndef print(*a, **k):\n    builtins.print('from my print:', *a, **k)\n"
                 "def double(v):\n    return 2 * v\nprint('what an answer cell prints is not compared')\n",
}
LEAKS = ("import json, os, sys\n"  # what of the grader a kernel could find about itself
         "seen = {'env': dict(os.environ), 'argv': open('/proc/self/cmdline').read(),\n"
         "        'parent': open(f'/proc/{os.getppid()}/cmdline').read()}\n"
         "open('seen.json', 'w').write(json.dumps(seen))\n"
         "def double(v):\n    return 2 * v\n")
DIES = {  # the kernel's process ends: in an answer cell, and in a check calling the answer
    "exit_in_answer": "import os\nos._exit(0)\n",
    "crash_in_check": "def double(v):\n    import ctypes\n    return ctypes.string_at(0)\n",
}


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tamper")
    save(DEMO, tmp / "solutions" / "07_demo.ipynb")
    paths = {name: _learner(tmp / name, src) for name, src in {
        **TAMPER, **RIGHT, "leaks": LEAKS, **DIES}.items()}
    lines = []
    start = time.monotonic()
    grades = grader.grade(list(paths.values()), solutions=tmp / "solutions", show=lines.append)
    return dict(zip(paths, grades)), lines, time.monotonic() - start, paths


@pytest.mark.parametrize("name", TAMPER)
def test_tampering_answer_fails_its_check(name, course):
    grades, lines, _, _ = course
    g = grades[name]
    assert not g.passed, "\n".join(lines)
    assert g.summary.split(": FAIL at ", 1)[1].startswith("Check 1: doubling"), g.summary


@pytest.mark.parametrize("name", RIGHT)
def test_right_answer_with_names_of_its_own_passes(name, course):
    grades, lines, _, _ = course
    assert grades[name].passed, "\n".join(lines)


def test_the_kernel_learns_nothing_of_the_grader(course):
    grades, lines, _, paths = course
    assert grades["leaks"].passed, "\n".join(lines)
    seen = json.loads((paths["leaks"].parent / "seen.json").read_text())
    assert not [k for k in seen["env"] if k.startswith(("MINITRON_GRADE", "PYTEST"))], sorted(seen["env"])
    text = json.dumps(seen)
    assert "minitron-verdict" not in text and "record" not in text, text


def test_a_dead_kernel_is_said_at_once(course):
    grades, lines, seconds, _ = course
    assert seconds < 300, f"{seconds:.0f} s: a dead kernel waited for its cell's timeout"
    exits = grades["exit_in_answer"].summary
    assert exits.endswith("FAIL at your answer cell under 'Part 1 · `double`': it ended the Python "
                          "process (exit status 0)"), exits
    crash = grades["crash_in_check"].summary
    assert crash.endswith("FAIL at Check 1: doubling, run where the learner's notebook is: the Python process "
                          "ended while it ran: something it called ended it (exit status -11)"), crash
    assert "ran out of time" not in exits + crash


KILLER = (  # issue 20 §1: a record saying every cell of every notebook passed, then nbval's pytest killed
    "import json, os, signal\n"
    "parent = f'/proc/{os.getppid()}'\n"
    "cwd = os.readlink(parent + '/cwd')\n"
    "graded = [os.path.join(r, f) for r, _, files in os.walk(cwd) for f in files if f.endswith('.ipynb')]\n"
    "fake = {os.path.realpath(p): {str(n): {'outcome': 'passed'} for n in range(100)} for p in graded}\n"
    "places = [os.environ.get('MINITRON_GRADE_RECORD'), os.path.join(cwd, 'record.json')]\n"
    "places += [os.path.join(r, f) for r, _, files in os.walk(cwd) for f in files if f.endswith('.json')]\n"
    "for place in filter(None, places):\n"
    "    with open(place, 'w') as f:\n"
    "        json.dump(fake, f)\n"
    "os.kill(os.getppid(), signal.SIGKILL)\n"
    "def double(v):\n    return 2 * v\n")


def test_a_notebook_that_kills_the_grading_decides_only_its_own_verdict(tmp_path):
    save(DEMO, tmp_path / "solutions" / "07_demo.ipynb")
    killer = _learner(tmp_path / "killer", KILLER)
    unsolved = _learner(tmp_path / "unsolved", "def double(v):\n    raise NotImplementedError('your code here')\n")
    right = _learner(tmp_path / "right", "def double(v):\n    return 2 * v\n")
    lines = []
    g_killer, g_unsolved, g_right = grader.grade([killer, unsolved, right], solutions=tmp_path / "solutions",
                                                 show=lines.append)
    assert "its grading did not finish (the run ended with status -9)" in g_killer.summary, "\n".join(lines)
    assert "is not written yet" in g_unsolved.summary, g_unsolved.summary
    assert g_right.passed, "\n".join(lines)
