"""What one grading runs: the reference notebook with the learner's answer cells, and what each
of its cells must show.

`merge` takes the reference (solutions/NN_*.ipynb) and puts in, by cell id, only the sources of
the learner's answer cells (those holding `# BEGIN SOLUTION`); its notes tell the learner what
was ignored (an edited check cell, an extra cell) or missing. `job_for` reads, from the
reference's stored outputs, the values each check cell must show again (or, for a check not yet
converted to `show`, the text it printed), and which cells the reference's tests skip.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

from minitron.grade import report
from minitron.grade.judge import Shown
from minitron.grade.report import is_answer_cell, source
from minitron.grade.values import VALUE_MIME

MISSING_ANSWER = 'raise NotImplementedError("your notebook has no answer cell {id}: nothing to grade")\n'


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


@dataclass
class Job:
    """One notebook to grade: its cells to run, in order, with what the reference says of each."""
    merged: dict
    cells: list["Cell"]


@dataclass
class Cell:
    number: int                  # among the notebook's code cells (the count the names use)
    source: str
    answer: bool                 # the learner's: only its status counts
    shown: list[Shown]           # the reference's values (its stored outputs)
    text: str | None             # a check that shows no value: the reference's printed text
                                 # (compared as text until the check is converted to show)
    run: bool = True             # False: skipped (NBVAL_SKIP), as the reference's tests skip it


def _reference_values(cell: dict) -> list[Shown]:
    found = []
    for out in cell.get("outputs") or []:
        data = out.get("data", {}) if out.get("output_type") in ("display_data", "execute_result") else {}
        if VALUE_MIME in data:
            found.append(Shown.from_data(data[VALUE_MIME]))
    return found


def job_for(merged: dict) -> Job:
    """What to run and what to expect, read from the merged notebook (the reference's outputs)."""
    cells = []
    for number, cell in enumerate(c for c in merged["cells"] if c["cell_type"] == "code"):
        text, tags = source(cell), cell.get("metadata", {}).get("tags", [])
        answer = bool(cell.get("metadata", {}).get("minitron_answer"))
        ignored = answer or "NBVAL_IGNORE_OUTPUT" in text or "nbval-ignore-output" in tags
        shown = [] if ignored else _reference_values(cell)
        legacy = None
        if not ignored and not shown and cell.get("outputs"):
            legacy = report.output_text(cell["outputs"])
        cells.append(Cell(number, text, answer, shown, legacy,
                          run="NBVAL_SKIP" not in text and "nbval-skip" not in tags))
    return Job(merged, cells)
