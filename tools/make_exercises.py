"""Build exercises/NN_*.ipynb from solutions/NN_*.ipynb.

In a solution notebook, the code a learner must write sits between two marker lines:

    # BEGIN SOLUTION
    ...
    # END SOLUTION

The exercise keeps every cell and every stored output of the solution (they are what
nbval grades against) and replaces each marked block by a stub that raises
NotImplementedError, keeping the indentation. `--check` fails when an exercise is stale.

    python tools/make_exercises.py            # write missing exercises
    python tools/make_exercises.py --force    # rewrite all (after changing a solution)
    python tools/make_exercises.py --check    # exit 1 if any exercise is out of date

Without --force an existing exercise is never overwritten: it may hold a learner's work.
"""
from __future__ import annotations

import copy
import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"^([ \t]*)# BEGIN SOLUTION\n.*?^[ \t]*# END SOLUTION\n?", re.S | re.M)


def stub_source(source: str) -> str:
    def stub(m: re.Match) -> str:
        return f'{m.group(1)}raise NotImplementedError("your code here")\n'
    return BLOCK.sub(stub, source)


def exercise_from(solution: dict) -> dict:
    nb = copy.deepcopy(solution)
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        src = "".join(cell["source"])
        if "# BEGIN SOLUTION" in src:
            new = stub_source(src)
            cell["source"] = new.splitlines(keepends=True)
    return nb


def render(nb: dict) -> str:
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"


def main(argv: list[str]) -> int:
    check, force = "--check" in argv, "--force" in argv
    stale = []
    for sol in sorted((ROOT / "solutions").glob("*.ipynb")):
        target = ROOT / "exercises" / sol.name
        text = render(exercise_from(json.loads(sol.read_text())))
        if "raise NotImplementedError" not in text:
            raise SystemExit(f"{sol.name} has no '# BEGIN SOLUTION' block: nothing to exercise")
        if check:
            if not target.exists() or target.read_text() != text:
                stale.append(target.name)
        elif target.exists() and target.read_text() != text and not force:
            print(f"kept {target.relative_to(ROOT)}: it differs from the generated one (a "
                  "learner's work?); pass --force to replace it")
        else:
            target.write_text(text)
            print(f"wrote {target.relative_to(ROOT)}")
    if stale:
        print("out of date (run python tools/make_exercises.py):", ", ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
