"""Grade exercise notebooks against their reference solutions.

    python -m minitron.grade                          # every notebook in exercises/
    python -m minitron.grade exercises/01_tensor_parallel_mlp.ipynb
    python -m minitron.grade --stamp solutions/*.ipynb   # record this torch in the references

What runs is the REFERENCE (solutions/NN_*.ipynb: its set-up and check cells) with only its
answer cells, those holding `# BEGIN SOLUTION`, taken from the learner's notebook by cell id:
the learner's stored outputs, edited check cells and extra cells play no part.

This file is the grading run and its command line; job.py builds what each notebook runs (the
merged notebook, each cell's expected values), run_job.py runs it in a kernel and judges each
cell. Their names are importable from here too (tests use grade.cli.merge, .source, ...).

Where the verdict is made (issue 31). This process is the judge: it never runs learner code.
It reads the references, the learner's notebooks and the package (course_copy.py) once, at the
start, and makes itself non-dumpable. Each notebook's cells then run, one request at a time, in
a kernel of their own (kernel.py) started in a fresh throwaway copy of the package, without
privileges when the grader is root; nothing the kernel can read names a file of the course
or holds the reference's outputs (those stay in this process). From the kernel only data comes
back: each cell's reply status, the exception it reported, and the values its check showed
(minitron/grade/values.py, as JSON). A check passes when it ended with status "ok" and showed
the reference's values, label by label, within the reference's tolerance (judge.py); a cell
that ends any other way (an error, an abort, a dead kernel, a timeout, a value missing) fails,
named. What a cell prints or warns is never compared. Nothing is run again on account of
anything a kernel says.

Not defended: an answer that produces the right values by other means than its own code
(calling minitron's implementation, hard-coding the values an exercise shows); a kernel
that searches the whole disk for the references or the course, or stops the grading (no
verdict then for anyone in that run, never a PASS). Grading for credit: run it where the
kernel can reach neither (`--kernel-user` as root, or a container; README, "Grading").
"""
from __future__ import annotations

import argparse
import ctypes
import json
from dataclasses import dataclass, field
from pathlib import Path

from minitron.grade import report
from minitron.grade.course_copy import Pristine
from minitron.grade.job import (MISSING_ANSWER, Cell, Job, job_for, merge,  # noqa: F401 (re-exported)
                                reference_for)
from minitron.grade.kernel import kernel_user
from minitron.grade.recorded import stamp, torch_line, torch_version
from minitron.grade.report import is_answer_cell, source  # noqa: F401  (tests use grade.*)
from minitron.grade.run_job import run_job, verdict  # noqa: F401 (re-exported)

COURSE = Path(__file__).resolve().parents[2]   # the course: minitron/grade/cli.py -> the root


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


def grade(paths: list[Path], solutions: Path | None = None, cell_timeout: int = 600,
          show=print, verbose: bool = False, kernel_user_name: str | None = None) -> list[Grade]:
    """Grade each learner notebook; show() gets the notes, details and one summary line each."""
    user = kernel_user(kernel_user_name)
    _not_dumpable()
    pristine = Pristine(COURSE)  # read once, before any learner code runs
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
        try:
            job = job_for(merged)
        except ValueError as e:
            g.error = f"its reference {ref_path} holds a value that is not plain data ({e})"
            continue
        g.checked = sum(1 for c in job.cells if c.run and (c.shown or c.text is not None))
        jobs.append((g, job))
    line = torch_line(references)
    if line:
        show(line)
    if jobs:
        show(f"grading {', '.join(str(g.path) for g, _ in jobs)} (every cell runs: this takes a while)")
        for g, job in jobs:
            try:
                g.failures = run_job(job, pristine, cell_timeout, show, verbose, user)
            except RuntimeError as e:  # the kernel would not start, twice: no verdict on the answers
                g.error = f"its kernel did not start ({e})"
    for g in grades:
        for line in g.notes + [d for f in g.failures[:1] for d in f.details()]:
            show(f"{g.path}: {line}")
    show("")
    for g in grades:
        show(g.summary)
    return grades


def _not_dumpable() -> None:
    """Keep a kernel of this user's from reading this process's memory, files and folder
    through /proc (Linux's PR_SET_DUMPABLE; a kernel running as another user cannot anyway)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)
    except (OSError, AttributeError):
        pass


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
    parser.add_argument("--verbose", action="store_true", help="also show what the cells printed")
    parser.add_argument("--kernel-user", help="run the notebooks' kernels as this user (grading for credit, "
                                              "as root: a user owning nothing of the course)")
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
    grades = grade(paths, args.solutions, args.cell_timeout, verbose=args.verbose,
                   kernel_user_name=args.kernel_user)
    return 0 if all(g.passed for g in grades) else 1
