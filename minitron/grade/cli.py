"""Grade exercise notebooks against their reference solutions.

    python -m minitron.grade                          # every notebook in exercises/
    python -m minitron.grade exercises/01_tensor_parallel_mlp.ipynb
    python -m minitron.grade --stamp solutions/*.ipynb   # record this torch in the references

What is run is the REFERENCE (solutions/NN_*.ipynb: every check cell and the outputs stored
with it) with only its answer cells, those holding `# BEGIN SOLUTION`, taken from the learner's
notebook, matched by cell id. So the learner's stored outputs, edits to check cells and extra
cells cannot make a wrong answer pass; a notebook with cleared outputs is graded all the same.
nbval runs the merged copy in a temporary folder (the kernel starts in the learner's folder);
the learner's file is only read. The last lines say, per notebook, PASS or which check failed
and why, in words. Exit status 1 if any notebook fails.

What an answer cell does cannot change the verdict on a right or a wrong answer:
  * the check cells run in a namespace of their own (minitron/grade/plugin.py, _kernel_guard):
    the set-up's and checks' own names, and of the learner's only the functions and classes
    the reference's answer cells define, bound afresh before each check; with the kernel's
    own builtins, output streams and IPython transformers and hooks put back first. So a
    helper of the learner's named like one of the check's, a global `print`, a rebound
    import or an input transformer reach no check;
  * the verdict is read only from a run of nbval that ended by itself, from a record signed
    with a key handed to nbval's process on a pipe (nothing in the kernel's environment or
    on a command line); a run that did not end so is repeated one notebook per run, so that
    one notebook cannot decide another's verdict;
  * a kernel that dies (os._exit, a crash) fails at once, naming the cell it died in.
Not defended: an answer that patches the installed packages (torch, minitron, nbval), or whose
functions, while a check calls them, patch sys.stdout or go looking for the grader's objects
inside the kernel; that is deliberate, and visible in the answer itself.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import hmac
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from minitron.grade import report
from minitron.grade.recorded import stamp, torch_line, torch_version
from minitron.grade.report import is_answer_cell, source  # noqa: F401  (tests use grade.*)

COURSE = Path(__file__).resolve().parents[2]   # the course: minitron/grade/cli.py -> the root
MISSING_ANSWER = 'raise NotImplementedError("your notebook has no answer cell {id}: nothing to grade")\n'


@dataclass
class Grade:
    """The verdict on one learner notebook."""
    path: Path
    notes: list[str] = field(default_factory=list)       # edited check cells, extra or missing cells
    failures: list[report.Failure] = field(default_factory=list)
    checked: int = 0                                       # cells whose output is compared
    error: str = ""                                        # set when it could not be graded at all

    @property
    def passed(self) -> bool:
        return not self.error and not self.failures

    @property
    def summary(self) -> str:
        if self.error:
            return f"{self.path}: FAIL: {self.error}"
        if self.passed:
            return f"{self.path}: PASS ({self.checked} checked cells reproduce the reference)"
        first, more = self.failures[0], len(self.failures) - 1
        tail = f" ({more} later cell{'s fail' if more > 1 else ' fails'} too)" if more else ""
        return f"{self.path}: FAIL at {first.where}: {first.reason}{tail}"


def merge(learner: dict, reference: dict) -> tuple[dict, list[str]]:
    """The notebook to grade: the reference with its answer cells' sources from the learner.

    Returns it and the notes to show the learner. An answer cell whose reference prints nothing
    may print anything (its output is not compared); check cells are always the reference's.
    """
    names = report.cell_names(reference)
    theirs = {c.get("id"): c for c in learner.get("cells", []) if c.get("id")}
    graded, notes = copy.deepcopy(reference), []
    for number, cell in enumerate(c for c in graded["cells"] if c["cell_type"] == "code"):
        mine = theirs.get(cell.get("id"))
        if is_answer_cell(cell):
            cell.setdefault("metadata", {})["minitron_answer"] = True
            if mine is None:
                notes.append(f"your notebook has no answer cell {cell.get('id')} (the "
                             f"{names[number].removeprefix('your ')}): graded as unsolved")
                cell["source"] = MISSING_ANSWER.format(id=cell.get("id"))
            else:
                cell["source"] = source(mine)
            if not cell.get("outputs"):
                cell["metadata"]["tags"] = ["nbval-ignore-output"]
        elif mine is not None and source(mine) != source(cell):
            notes.append(f"you edited a check cell ({names[number]}, id {cell.get('id')}); "
                         "the reference's is used")
    known = {c.get("id") for c in reference["cells"]}
    for cell in learner.get("cells", []):
        if cell.get("cell_type") == "code" and cell.get("id") not in known and source(cell).strip():
            first = source(cell).strip().splitlines()[0][:60]
            notes.append(f"your cell {cell.get('id')} ({first!r}) is not part of the exercise: not run")
    return graded, notes


def reference_for(learner: Path, solutions: Path) -> Path | None:
    same = solutions / learner.name
    if same.exists():
        return same
    number = learner.name.split("_", 1)[0] + "_"
    found = sorted(solutions.glob(number + "*.ipynb")) if number[:-1].isdigit() else []
    return found[0] if len(found) == 1 else None


KERNEL_START_FAILED = "Kernel died before replying to kernel_info"
PLUGIN = "minitron_grade_plugin"  # minitron/grade/plugin.py, as nbval's process imports it


@dataclass
class Job:
    """One merged notebook to run: where the learner's notebook is, and what it asks for."""
    merged: dict
    folder: Path                                           # the learner's notebook's folder
    name: str                                              # the reference's file name
    names: list[str]                                       # what its answer cells define


class RunFailed(RuntimeError):
    """nbval's run ended without a record the grader can trust."""


def _run_nbval(jobs: list[Job], cell_timeout: int) -> tuple[list[dict], str]:
    """Run nbval on the merged notebooks; each one's cells' records, in order, and its output.

    Every run gets a fresh folder for the copies and the plugin, and the plugin its settings
    and a new signing key on a pipe. A record counts only if pytest ended by itself (status 0
    or 1) and the record carries the key's signature: a kernel can kill pytest, write files
    and find folders, but it cannot sign.
    """
    with tempfile.TemporaryDirectory(prefix="minitron-grade-") as tmp, \
            tempfile.TemporaryDirectory(prefix="minitron-verdict-") as private:
        workdir = Path(tmp)
        (workdir / "pytest.ini").write_text("[pytest]\n")  # no configuration inherited from above
        # The plugin, copied beside the graded copies (cwd, on the path of `python -m`), is imported
        # as a module of its own: as minitron.grade.plugin it would import the package, and torch.
        shutil.copyfile(Path(__file__).with_name("plugin.py"), workdir / f"{PLUGIN}.py")
        targets = []
        for k, job in enumerate(jobs):
            target = workdir / str(k) / job.name
            target.parent.mkdir()
            target.write_text(json.dumps(job.merged, indent=1, ensure_ascii=False))
            targets.append(target.resolve())
        key, record = secrets.token_bytes(32), Path(private) / f"{secrets.token_hex(8)}.json"
        config = json.dumps({"record": str(record), "key": key.hex(), "token": secrets.token_hex(16),
                             "notebooks": {str(t.parent): {"cwd": str(j.folder), "names": j.names}
                                           for t, j in zip(targets, jobs)}})
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(COURSE), env.get("PYTHONPATH")]))
        read, write = os.pipe()
        with os.fdopen(write, "w") as pipe:  # far below a pipe's buffer: written before pytest starts
            pipe.write(config)
        cmd = [sys.executable, "-m", "pytest", "--nbval", "--nbval-current-env", "-p", PLUGIN,
               f"--minitron-config-fd={read}", "-p", "no:cacheprovider", "-q",
               f"--nbval-cell-timeout={cell_timeout}", *map(str, targets)]
        try:
            done = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, pass_fds=(read,))
        finally:
            os.close(read)  # pytest holds the only copy, and reads it before any kernel starts
        output = done.communicate()[0]
        if done.returncode in (3, 4, 5):  # pytest's internal error, usage error, nothing collected
            raise RuntimeError("nbval did not run (is it installed? `make setup` installs it):\n"
                               + output[-3000:])
        if done.returncode not in (0, 1):
            raise RunFailed(f"the run ended with status {done.returncode}", output)
        if not record.exists():
            raise RunFailed("it left no record", output)
        mac, _, body = record.read_text().partition("\n")
        if not hmac.compare_digest(mac, hmac.new(key, body.encode(), hashlib.sha256).hexdigest()):
            raise RunFailed("its record is not the one the grader's plugin signed", output)
    records = json.loads(body)
    return [records.get(str(t), {}) for t in targets], output


def _run_each_alone(jobs: list[Job], cell_timeout: int) -> tuple[list[dict | str], str]:
    """Records as _run_nbval's; when a run of several fails, each notebook runs again alone,
    so that one notebook's cells cannot decide another's verdict. A notebook whose own run
    fails gets the reason, a string, in place of its records."""
    try:
        return _run_nbval(jobs, cell_timeout)
    except RunFailed as failed:
        if len(jobs) == 1:
            return [str(failed.args[0])], failed.args[1]
    results, outputs = [], []
    for job in jobs:
        result, output = _run_each_alone([job], cell_timeout)
        results += result
        outputs.append(output)
    return results, "\n".join(outputs)


def _record(todo: list[tuple[Grade, Job]], cell_timeout: int, show, verbose: bool) -> None:
    """Run these notebooks and set each one's grade from its record."""
    results, output = _run_each_alone([job for _, job in todo], cell_timeout)
    if verbose:
        show(output)
    for (g, job), cells in zip(todo, results):
        g.error, g.failures = "", []
        if isinstance(cells, str):
            g.error = (f"its grading did not finish ({cells}): a cell of this notebook stopped "
                       "the grader's own process")
            continue
        g.failures = report.failures(job.merged, cells)
        if not g.failures and len(cells) < report.code_cells(job.merged):
            g.error = "not every cell ran (nbval's output follows):\n" + output[-2000:]


def grade(paths: list[Path], solutions: Path | None = None, cell_timeout: int = 600,
          show=print, verbose: bool = False) -> list[Grade]:
    """Grade each learner notebook; show() gets the notes, details and one summary line each."""
    solutions = solutions or COURSE / "solutions"
    grades, jobs, references = [], [], {}
    for path in paths:
        g = Grade(path)
        grades.append(g)
        ref_path = reference_for(path, solutions)
        if ref_path is None:
            g.error = f"no reference solution for it in {solutions}"
            continue
        reference = references[path] = json.loads(ref_path.read_text())
        try:
            merged, g.notes = merge(json.loads(path.read_text()), reference)
        except (OSError, ValueError, AttributeError, TypeError) as e:
            g.error = f"could not read it as a notebook ({e})"
            continue
        g.checked = report.checked_cells(merged)
        jobs.append((g, Job(merged, path.resolve().parent, ref_path.name, report.learner_names(reference))))
    line = torch_line(references)
    if line:
        show(line)
    if jobs:
        show(f"grading {', '.join(str(g.path) for g, _ in jobs)} (every cell runs: this takes a while)")
        _record(jobs, cell_timeout, show, verbose)
        # A kernel that died starting up (two kernels that picked the same free port, say)
        # says nothing about the answers; nor, beside other notebooks, does one that died later
        # (another notebook's cell may have killed it): grade those once more, each alone.
        for g, job in jobs:
            if any(KERNEL_START_FAILED in x.message for x in g.failures) or (
                    len(jobs) > 1 and g.failures and g.failures[0].died):
                _record([(g, job)], cell_timeout, show, verbose)
    for g in grades:
        for line in g.notes + [d for f in g.failures[:1] for d in f.details()]:
            show(f"{g.path}: {line}")
    show("")
    for g in grades:
        show(g.summary)
    return grades


def _notebooks(args: list[str], default: Path) -> list[Path]:
    paths = []
    for arg in args or [str(default)]:
        p = Path(arg)
        paths += sorted(p.glob("*.ipynb")) if p.is_dir() else [p]
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minitron.grade", description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*",
                        help="notebooks or folders (default: exercises/, with --stamp solutions/)")
    parser.add_argument("--solutions", type=Path, help="folder of reference solutions (default: solutions/)")
    parser.add_argument("--cell-timeout", type=int, default=600, help="seconds per cell (default 600)")
    parser.add_argument("--verbose", action="store_true", help="also show nbval's own output")
    parser.add_argument("--stamp", action="store_true",
                        help="record this torch version in the given reference notebooks, then stop")
    parser.add_argument("--torch", help="with --stamp: the version to record (default: this torch)")
    args = parser.parse_args(argv)
    paths = _notebooks(args.paths, COURSE / ("solutions" if args.stamp else "exercises"))
    if args.stamp:
        for p in paths:
            stamp(p, args.torch)
            print(f"stamped {p}: recorded with torch {args.torch or torch_version()}")
        return 0
    if not paths:
        parser.error("no notebooks to grade")
    grades = grade(paths, args.solutions, args.cell_timeout, verbose=args.verbose)
    return 0 if all(g.passed for g in grades) else 1
