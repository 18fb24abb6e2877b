"""Build exercises/NN_*.ipynb from solutions/NN_*.ipynb.

In a solution notebook, the code a learner must write sits between two marker lines:

    # BEGIN SOLUTION
    ...
    # END SOLUTION

The exercise keeps every cell of the solution and replaces each marked block by a stub that
raises NotImplementedError, keeping the indentation. It keeps the solution's stored outputs
except those of check cells (cells that call `show(`): a check shows the values the learner is
asked to compute, so the reference's would hand them the answers. The grader compares with the
reference's outputs, never the exercise's. A marker
that is not closed, a stray END, a nested BEGIN or a marker sharing its line with code is
an error naming the notebook and the cell: the solution would otherwise leak into the exercise.
`--check` fails when an exercise is stale.

    python tools/make_exercises.py            # write missing exercises
    python tools/make_exercises.py --force    # rewrite all (after changing a solution)
    python tools/make_exercises.py --check    # exit 1 if any exercise is out of date

Without --force an existing exercise is never overwritten: it may hold a learner's work.
(--solutions DIR and --exercises DIR choose other folders, for tests.)
"""
from __future__ import annotations

import argparse
import copy
import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
BEGIN, END = "# BEGIN SOLUTION", "# END SOLUTION"
# a check cell hands the grader values with minitron.grade.values.show (not plt.show)
SHOW = re.compile(r"(?<![\w.])show\(")
STUB = 'raise NotImplementedError("your code here")'


class MarkerError(ValueError):
    """A solution cell whose markers do not pair up."""


def stub_source(source: str) -> str:
    """The source with each BEGIN/END block replaced by a stub at the BEGIN line's indent."""
    out, begin = [], None
    for number, line in enumerate(source.splitlines(keepends=True), start=1):
        marker = line.strip()
        if marker not in (BEGIN, END) and (BEGIN in line or END in line):
            raise MarkerError(f"line {number} holds a marker and code: put '{marker}' alone on its line")
        if marker == BEGIN:
            if begin is not None:
                raise MarkerError(f"line {number}: '{BEGIN}' inside the block opened at line {begin}")
            begin = number
            out.append(line[: len(line) - len(line.lstrip())] + STUB + "\n")
        elif marker == END:
            if begin is None:
                raise MarkerError(f"line {number}: '{END}' without a '{BEGIN}' before it")
            begin = None
        elif begin is None:
            out.append(line)
    if begin is not None:
        raise MarkerError(f"'{BEGIN}' at line {begin} is never closed by '{END}'")
    return "".join(out)


def exercise_from(solution: dict, name: str = "the solution") -> dict:
    nb = copy.deepcopy(solution)
    for number, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        src = "".join(cell["source"])
        if SHOW.search(src):              # a check cell: its outputs are the answers
            cell["outputs"], cell["execution_count"] = [], None
        if BEGIN in src or END in src:
            try:
                new = stub_source(src)
            except MarkerError as e:
                raise MarkerError(f"{name}, cell {number} (id {cell.get('id')}): {e}; "
                                  "the solution would leak into the exercise") from None
            cell["source"] = new.splitlines(keepends=True)
    return nb


def shown(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def render(nb: dict) -> str:
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="Build exercises/ from solutions/.")
    parser.add_argument("--check", action="store_true", help="exit 1 if an exercise is out of date")
    parser.add_argument("--force", action="store_true", help="rewrite every exercise, even one holding a learner's work")
    parser.add_argument("--solutions", type=pathlib.Path, default=ROOT / "solutions")
    parser.add_argument("--exercises", type=pathlib.Path, default=ROOT / "exercises")
    args = parser.parse_args(argv)
    stale = []
    for sol in sorted(args.solutions.glob("*.ipynb")):
        target = args.exercises / sol.name
        try:
            text = render(exercise_from(json.loads(sol.read_text()), shown(sol)))
        except MarkerError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if "raise NotImplementedError" not in text:
            print(f"error: {shown(sol)} has no '{BEGIN}' block: nothing to exercise", file=sys.stderr)
            return 2
        if args.check:
            if not target.exists() or target.read_text() != text:
                stale.append(target.name)
        elif target.exists() and target.read_text() != text and not args.force:
            print(f"kept {shown(target)}: it differs from the generated one (a learner's work?); "
                  "pass --force to replace it")
        else:
            target.write_text(text)
            print(f"wrote {shown(target)}")
    if stale:
        print("out of date (run python tools/make_exercises.py):", ", ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
