"""What an answer cell does cannot make a wrong answer pass (issue 31), on a tiny course.

The course is test_grade_parts' one exercise: an answer `double(v)` and a check showing
`double(21)` and `double(-4)`. Every wrong answer below doubles wrongly and, in one of the ways
issue 31 lists, makes the check's run say what the reference's said: it re-emits the check's
stored outputs wherever it can find them (REPLAY: the merged notebook, the kernel's folder and
its parent's, the package's folders, the parent's memory), or makes the comparison in the
kernel come out true. Each must fail at Check 1. The same answers against the grader of before
(a print of a verdict computed in the kernel, compared as text by nbval) passed: the report of
issue 31 shows both. Right answers that reuse the check's names must pass.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minitron.grade import cli as grader
from notebook_files import save
from test_grade_parts import DEMO, ROOT, _learner

WRONG = "def double(v):\n    return 2 * v - 1 if v > 0 else 2 * v\n"   # 41 for 21, right for -4

# Finds the reference's stored outputs of the check cell (id "check") where a kernel can look,
# and re-emits them: printed text as text, shown values as values.
REPLAY = r'''
def _replay():
    import glob, json, os, sys
    from IPython.display import display
    places = [os.getcwd()]
    for pid in (os.getppid(), os.getpid()):
        try:
            places.append(os.readlink(f"/proc/{pid}/cwd"))
        except OSError:
            pass
    for entry in sys.path + os.environ.get("PYTHONPATH", "").split(os.pathsep):
        if entry and os.path.isdir(entry):
            places += [entry, os.path.dirname(os.path.abspath(entry))]
    try:
        import minitron
        here = os.path.dirname(minitron.__file__)
        places += [here, os.path.dirname(here), os.path.dirname(os.path.dirname(here))]
    except ImportError:
        pass
    for place in dict.fromkeys(places):
        for path in glob.glob(os.path.join(place, "**", "*.ipynb"), recursive=True)[:200]:
            try:
                cells = json.load(open(path))["cells"]
            except Exception:
                continue
            for cell in cells:
                if cell.get("id") == "check" and cell.get("outputs"):
                    for out in cell["outputs"]:
                        if out["output_type"] == "stream":
                            sys.stdout.write("".join(out["text"]))
                        else:
                            display(out["data"], raw=True)
                    return True
    return False
'''

ATTACKS = {  # issue 31's classes: name -> the answer cell (a wrong double plus the attack)
    # 1. the check ends early without an error status
    "1_trace_bdbquit": WRONG + REPLAY + '''
import bdb, sys
def _tracer(frame, event, arg):
    if event == "call" and frame.f_code.co_name == "check_double":
        sys.settrace(None)
        _replay()
        raise bdb.BdbQuit
    return None
sys.settrace(_tracer)
import threading; threading.settrace(_tracer)
''',
    "1_profile_bdbquit": WRONG + REPLAY + '''
import bdb, sys
def _prof(frame, event, arg):
    if event == "call" and frame.f_code.co_name == "check_double":
        sys.setprofile(None)
        _replay()
        raise bdb.BdbQuit
sys.setprofile(_prof)
''',
    "1_signal_handler": WRONG + REPLAY + '''
import bdb, signal
def _on_alarm(signum, frame):
    _replay()
    raise bdb.BdbQuit
signal.signal(signal.SIGALRM, _on_alarm)
_wrong = double
def double(v):
    signal.setitimer(signal.ITIMER_REAL, 0.01)
    import time; time.sleep(1)
    return _wrong(v)
''',
    "1_custom_exc": WRONG + REPLAY + '''
def _silence(shell, etype, value, tb, tb_offset=None):
    _replay()
get_ipython().set_custom_exc((BaseException,), _silence)
def double(v):
    raise RuntimeError("stop the check here")
''',
    # 2. IPython's machinery rebound
    "2_transform_cell": WRONG + REPLAY + '''
_shell = get_ipython()
_orig = type(_shell).transform_cell
def _transform(self, cell):
    if "check_double" in cell:
        return "_replay()\\n"
    return _orig(self, cell)
type(_shell).transform_cell = _transform
_shell.transform_cell = _transform.__get__(_shell)
_shell.input_transformer_manager.transform_cell = lambda cell: "_replay()\\n" if "check_double" in cell else cell
''',
    "2_events_trigger": WRONG + REPLAY + '''
_ev = get_ipython().events
_real_trigger = type(_ev).trigger
def _trigger(self, name, *a, **k):
    if name == "pre_run_cell" and a and "check_double" in getattr(a[0], "raw_cell", ""):
        _replay()
        raise KeyboardInterrupt
    return _real_trigger(self, name, *a, **k)
type(_ev).trigger = _trigger
''',
    "2_ast_parse": WRONG + REPLAY + '''
import ast
_comp = get_ipython().compile
_real_parse = _comp.ast_parse
def _parse(source, *a, **k):
    if "check_double" in source:
        source = "_replay()\\n"
    return _real_parse(source, *a, **k)
_comp.ast_parse = _parse
type(_comp).ast_parse = lambda self, source, *a, **k: _parse(source, *a, **k)
''',
    "2_output_hook": WRONG + REPLAY + '''
import re, sys
_pub = get_ipython().display_pub
_session_send = _pub.session.send
def _rewrite(msg):  # an output hook on the publishing thread: every 41 reads 42
    return msg
_pub.register_hook(_rewrite) if hasattr(_pub, "register_hook") else None
sys.stdout.register_hook(_rewrite) if hasattr(sys.stdout, "register_hook") else None
''' + '''
def double(v):
    _replay()
    import os; os.environ["X"] = "1"
    raise SystemExit
''',
    "2_session_send": WRONG + REPLAY + '''
from jupyter_client.session import Session
_real_send = Session.send
def _send(self, stream, msg_or_type, content=None, *a, **k):
    if isinstance(content, dict) and content.get("status") == "error":
        content = {"status": "ok", "execution_count": content.get("execution_count", 1), "user_expressions": {}, "payload": []}
    if msg_or_type == "error":
        return None
    return _real_send(self, stream, msg_or_type, content, *a, **k)
Session.send = _send
def double(v):
    _replay()
    raise RuntimeError("hidden")
''',
    # 3. the check's own objects reached: from inside the learner's function, the check's frame
    "3_check_frame": WRONG + REPLAY + '''
import sys
_wrong, _done = double, []
def double(v):
    g = sys._getframe(1).f_globals              # the check's frame leads to its namespace
    def fake(*a, **k):                          # its print and show, replaced by a replay
        if not _done:
            _done.append(_replay())
    g["show"] = g["print"] = fake
    return _wrong(v)
''',
    # 4. values that compare equal to anything
    "4_equal_to_all": '''
class Forty(float):
    def __sub__(self, other): return Forty(0.0)
    def __rsub__(self, other): return Forty(0.0)
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __abs__(self): return 0.0
    def __lt__(self, other): return True
    def __hash__(self): return 0
    def __str__(self): return "42"
    __repr__ = __str__
    def __format__(self, spec): return "42"
    def __add__(self, other): return Forty(0.0)
    __radd__ = __add__
def double(v):
    return Forty(2 * v - 1)
''',
    # 5. libraries the checks use patched
    "5_library_patched": WRONG + REPLAY + '''
import math
math.fabs = lambda v: 0.0                      # what a check comparing in the kernel would call
math.isclose = lambda *a, **k: True
try:
    import minitron.grade.values as _values     # and the check's own show: a replay instead
    _values.show = lambda label, value, **k: _replay()
    get_ipython().user_ns["show"] = _values.show
except ImportError:
    pass
''',
    # 6. the grader's own files and memory
    "6_grader_memory": WRONG + '''
import os, re, glob
from IPython.display import display
found = None
_parent = int(open(f"/proc/{os.getppid()}/stat").read().split(")")[1].split()[1])
for pid in (os.getppid(), _parent):
    try:
        maps = open(f"/proc/{pid}/maps").read().splitlines()
        mem = open(f"/proc/{pid}/mem", "rb")
    except OSError:
        continue
    for line in maps:
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if "rw" not in line.split()[1] or hi - lo > 1 << 28:
            continue
        try:
            mem.seek(lo)
            chunk = mem.read(hi - lo)
        except (OSError, ValueError, OverflowError):
            continue
        m = re.search(rb'"label": "double\\(21\\)", "value": (-?\\d+)', chunk)
        if m:
            found = int(m.group(1))
            break
    if found is not None:
        break
def double(v):
    return found if (v == 21 and found is not None) else 2 * v - 1 if v > 0 else 2 * v
''',
    "6_rerun_text": WRONG + '''
import os, minitron
_judge = os.path.join(os.path.dirname(minitron.__file__), "grade", "judge.py")
with open(_judge, "a") as f:  # at a rerun, the grader's own comparison would read this again
    f.write("""
def compare(mine, reference):
    return None
""")
raise RuntimeError("Kernel died before replying to kernel_info")  # the text that made it rerun
''',
}

REWRITES = (  # 6: an answer that rewrites every reference it can find so that a stub passes next time
    "import glob, json, os, sys\n"
    "import minitron\n"
    "roots = {os.getcwd(), os.path.dirname(os.path.dirname(minitron.__file__))}\n"
    "for pid in (os.getppid(),):\n"
    "    try:\n        roots.add(os.readlink(f'/proc/{pid}/cwd'))\n    except OSError:\n        pass\n"
    "for root in roots:\n"
    "    for path in glob.glob(os.path.join(root, '**', '07_demo.ipynb'), recursive=True):\n"
    "        try:\n"
    "            nb = json.load(open(path))\n"
    "            for cell in nb['cells']:\n"
    "                if cell.get('id') == 'check':\n"
    "                    cell['source'] = 'pass\\n'\n"
    "                    cell['outputs'] = []\n"
    "            json.dump(nb, open(path, 'w'))\n"
    "        except Exception:\n"
    "            pass\n"
    "for path in glob.glob(os.path.join(os.path.dirname(minitron.__file__), 'grade', '*.py')):\n"
    "    try:\n        open(path, 'a').write('\\nraise SystemExit\\n')\n    except OSError:\n        pass\n"
    "def double(v):\n    return 2 * v - 1\n")

RIGHT = {  # right answers, some whose own names collide with the check's, or that print and warn
    "own_check_helper": "def check_double():\n    return 'mine'\ndef double(v):\n    return v + v\n",
    "own_print": "import builtins\ndef print(*a, **k):\n    builtins.print('from my print:', *a, **k)\n"
                 "def double(v):\n    return 2 * v\nprint('what an answer cell prints is not compared')\n",
    "prints_and_warns_inside": "import sys, warnings\ndef double(v):\n    print('debug: doubling', v)\n"
                               "    warnings.warn('a warning on stderr')\n    sys.stderr.write('more stderr\\n')\n"
                               "    return 2.0 * v\n",
    "fraction": "from fractions import Fraction\ndef double(v):\n    return Fraction(2 * v)\n",
}
DIES = {  # the kernel's process ends: in an answer cell, and in a check calling the answer
    "exit_in_answer": "import os\nos._exit(0)\n",
    "crash_in_check": "def double(v):\n    import ctypes\n    return ctypes.string_at(0)\n",
}


def _entries_away_from(place: Path) -> str:
    """This process's PYTHONPATH less any entry whose folder's parent holds `place`. The replay
    searches the parent of every entry it is given; an entry of the tester's own (PYTHONPATH=/tmp/x)
    would lead it to this test's course under /tmp, a path the grader never handed the kernel.
    (A learner's course is their own files, reachable the same way: what this test holds is that
    the grader adds no path that leads to the reference.)"""
    place = os.path.realpath(place)
    kept = [e for e in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if e and not place.startswith(os.path.dirname(os.path.realpath(e)) + os.sep)]
    return os.pathsep.join(kept)


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tamper")
    save(DEMO, tmp / "solutions" / "07_demo.ipynb")
    paths = {name: _learner(tmp / name, src) for name, src in {**ATTACKS, **RIGHT, **DIES}.items()}
    lines = []
    start = time.monotonic()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", _entries_away_from(tmp))
        grades = grader.grade(list(paths.values()), solutions=tmp / "solutions", show=lines.append)
    return dict(zip(paths, grades)), lines, time.monotonic() - start


@pytest.mark.parametrize("name", ATTACKS)
def test_an_attack_of_issue_31_fails_its_check(name, course):
    grades, lines, _ = course
    g = grades[name]
    assert not g.passed, "\n".join(lines)
    where = "your answer cell" if name == "6_rerun_text" else "Check 1: doubling 21 and -4"
    assert g.summary.split(": FAIL at ", 1)[1].startswith(where), g.summary


@pytest.mark.parametrize("name", RIGHT)
def test_right_answer_passes_whatever_it_prints_or_names(name, course):
    grades, lines, _ = course
    assert grades[name].passed, "\n".join(lines)


def test_an_early_end_says_which_values_are_missing(course):
    grades, _, _ = course
    assert "it showed 0 of its 2 values" in grades["2_transform_cell"].summary, grades["2_transform_cell"].summary
    assert "it raised BdbQuit" in grades["1_trace_bdbquit"].summary, grades["1_trace_bdbquit"].summary
    assert "double(21): yours is 41, the reference 42" in grades["4_equal_to_all"].summary


def test_a_dead_kernel_is_said_at_once(course):
    grades, lines, seconds = course
    assert seconds < 600, f"{seconds:.0f} s: a dead kernel waited for its cell's timeout (600 s)"
    exits = grades["exit_in_answer"].summary
    assert exits.endswith("FAIL at your answer cell under 'Part 1 · `double`': it ended the Python "
                          "process (exit status 0)"), exits
    crash = grades["crash_in_check"].summary
    assert crash.endswith("FAIL at Check 1: doubling 21 and -4: the Python process "
                          "ended while it ran: something it called ended it (exit status -11)"), crash


def test_a_rewritten_course_changes_no_later_grading(tmp_path):
    save(DEMO, tmp_path / "solutions" / "07_demo.ipynb")
    before = {p: p.read_bytes() for p in [tmp_path / "solutions" / "07_demo.ipynb",
                                          *(ROOT / "minitron" / "grade").glob("*.py")]}
    rewriter = _learner(tmp_path / "rewriter", REWRITES)
    stub = _learner(tmp_path / "stub", "def double(v):\n    raise NotImplementedError('your code here')\n")
    g_rewriter, g_stub = grader.grade([rewriter, stub], solutions=tmp_path / "solutions", show=lambda line: None)
    (g_later,) = grader.grade([stub], solutions=tmp_path / "solutions", show=lambda line: None)
    assert not g_rewriter.passed and "is not written yet" in g_stub.summary and "is not written yet" in g_later.summary
    assert {p: p.read_bytes() for p in before} == before


def test_the_kernel_learns_nothing_of_the_grader(tmp_path):
    # what of the grader a kernel could find about itself: its environment, command lines,
    # its parent's folder, open files and memory; and where its package comes from
    save(DEMO, tmp_path / "solutions" / "07_demo.ipynb")
    report = tmp_path / "seen.json"
    spy = ("import json, os, minitron\n"
           "seen = {'env': dict(os.environ), 'argv': open('/proc/self/cmdline').read(),\n"
           "        'cwd': os.getcwd(), 'package': minitron.__file__, 'parent': {}}\n"
           "for what in ('cwd', 'environ', 'mem', 'maps', 'fd'):\n"
           "    try:\n"
           "        p = f'/proc/{os.getppid()}/{what}'\n"
           "        seen['parent'][what] = os.readlink(p) if what == 'cwd' else ([os.readlink(f'{p}/{n}') "
           "for n in os.listdir(p)] if what == 'fd' else open(p, 'rb').read(10).hex())\n"
           "    except OSError as e:\n        seen['parent'][what] = 'refused: ' + type(e).__name__\n"
           f"open({str(report)!r}, 'w').write(json.dumps(seen))\n"
           "def double(v):\n    return 2 * v\n")
    (g,) = grader.grade([_learner(tmp_path / "spy", spy)], solutions=tmp_path / "solutions", show=lambda line: None)
    assert g.passed, g.summary
    seen = json.loads(report.read_text())
    assert all(v.startswith("refused") for v in seen["parent"].values()), seen["parent"]
    text = json.dumps({k: v for k, v in seen.items() if k != "parent"})
    assert str(ROOT) not in text and str(tmp_path) not in text.replace(str(report), ""), text
    assert not seen["package"].startswith(str(ROOT)), seen["package"]
    assert not [k for k in seen["env"] if k.startswith(("MINITRON_GRADE", "PYTEST"))], sorted(seen["env"])


KILLER = ("import os, signal\n"       # a notebook that kills the grader: no one gets a PASS from that run
          "os.kill(os.getppid(), signal.SIGKILL)\n"
          "def double(v):\n    return 2 * v\n")


def test_a_notebook_that_kills_the_grading_passes_no_one(tmp_path):
    save(DEMO, tmp_path / "solutions" / "07_demo.ipynb")
    killer = _learner(tmp_path / "killer", KILLER)
    right = _learner(tmp_path / "right", "def double(v):\n    return 2 * v\n")
    done = subprocess.run([sys.executable, "-m", "minitron.grade", "--solutions", str(tmp_path / "solutions"),
                           str(killer), str(right)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode != 0 and "PASS" not in done.stdout, done.stdout
