"""Running one job: its cells, in order, in a fresh copy of the course and a kernel of their
own, and the verdict on each cell from the data the kernel sends back.

A cell's verdict reads only data: the reply's status, the exception the kernel reported and the
values its check showed (judge.py compares them with the reference's). A cell that died, timed
out, raised or showed other values fails, named; an answer cell is judged by its status alone.
"""
from __future__ import annotations

from minitron.grade import report
from minitron.grade.course_copy import Pristine
from minitron.grade.job import Cell, Job
from minitron.grade.judge import compare
from minitron.grade.kernel import CellRun, Kernel


def verdict(cell: Cell, run: CellRun, merged: dict, where: str) -> report.Failure | None:
    """None if this cell's run is the reference's, else why not. Only data is read: the reply's
    status, the exception the kernel reported, the values its shows published."""
    n = cell.number
    if run.status == "died":
        what = ("it ended the Python process" if cell.answer
                else "the Python process ended while it ran: something it called ended it")
        code = f" (exit status {run.exit_code})" if run.exit_code is not None else ""
        return report.Failure(n, where, "other", message=what + code, died=True)
    if run.status == "timeout":
        return report.Failure(n, where, "other", message="it ran out of time (no reply from the kernel)")
    if run.status == "error":
        raised = report.root_exception(run.ename, run.evalue, [report.plain(t) for t in run.traceback])
        yours = report.learner_function(merged, raised.function, raised.line)
        return report.Failure(n, where, "exception", raised.exception, raised.message,
                              yours or raised.function, bool(yours))
    if run.status != "ok":
        return report.Failure(n, where, "other", message=f"it did not finish (its status: {run.status})")
    if cell.answer:
        return None
    if run.bad_value:
        return report.Failure(n, where, "value", message=f"it published a value that is not plain data ({run.bad_value})")
    if cell.text is not None and not cell.shown:   # not yet converted to show: its text
        line, want, have = report.first_difference(cell.text, run.text)
        return None if not line else report.Failure(n, where, "output", expected=want, got=have, line=line,
                                                     message="its output differs from the reference")
    found = compare(run.shown, cell.shown)
    return None if found is None else report.Failure(n, where, "value", message=found)


def run_job(job: Job, pristine: Pristine, cell_timeout: int, show, verbose: bool,
            user: tuple[int, int] | None) -> list[report.Failure]:
    """Run one notebook in a fresh copy of the course and a kernel of its own; its failures."""
    copy = pristine.write(user)
    names = report.cell_names(job.merged)
    try:
        try:
            kernel = Kernel(copy.course, copy.cwd, copy.home, user)
        except RuntimeError:  # it died starting (before any learner code): once more
            kernel = Kernel(copy.course, copy.cwd, copy.home, user)
        failures = []
        try:
            for cell in job.cells:
                if not cell.run:
                    continue
                run = kernel.run(cell.source, cell_timeout)
                if verbose and run.text:
                    show(run.text.rstrip("\n"))
                failure = verdict(cell, run, job.merged, names[cell.number])
                if failure:
                    failures.append(failure)
                    if kernel.dead:
                        break
        finally:
            kernel.stop()
        return failures
    finally:
        copy.remove()
