"""A source listing a learner reads in a lesson is the package's code as it is now.

Convention: a lesson prints package source with cells made only of statements
`print(inspect.getsource(X))` (comments allowed), X an expression over the names the
notebook imports. This test finds every such cell, imports what the notebook imports (no
cell is executed), and compares the cell's stored stdout with `inspect.getsource(X) + "\\n"`
for each statement, in order. A cell that prints source any other way is reported, so no
listing escapes the check; a listing cell with no stored output shows nothing stale and passes.
"""
from __future__ import annotations

import ast
import difflib
import inspect
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LESSONS = sorted((ROOT / "lessons").glob("*.ipynb"))
CONVENTION = "write it as `print(inspect.getsource(X))` statements alone in their cell"


def _code(cell: dict) -> str:
    """A cell's Python, without IPython's line magics (`%matplotlib inline`) and shell escapes."""
    lines = "".join(cell["source"]).splitlines()
    return "\n".join("" if ln.lstrip().startswith(("%", "!")) else ln for ln in lines)


def _listed_expression(stmt: ast.stmt) -> ast.expr | None:
    """X when `stmt` is `print(inspect.getsource(X))`, else None."""
    if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)):
        return None
    call = stmt.value
    if not (isinstance(call.func, ast.Name) and call.func.id == "print"
            and len(call.args) == 1 and not call.keywords):
        return None
    inner = call.args[0]
    if (isinstance(inner, ast.Call) and ast.unparse(inner.func) == "inspect.getsource"
            and len(inner.args) == 1 and not inner.keywords):
        return inner.args[0]
    return None


def _imports(cells: list[dict]) -> dict:
    """The namespace the notebook's import statements build, run in cell order."""
    namespace: dict = {}
    for cell in cells:
        for stmt in ast.parse(_code(cell)).body:
            if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                exec(compile(ast.Module([stmt], []), "<notebook imports>", "exec"), namespace)
    return namespace


def _stored_stdout(cell: dict) -> str:
    return "".join("".join(o["text"]) for o in cell.get("outputs", [])
                   if o["output_type"] == "stream" and o["name"] == "stdout")


def _first_difference(stored: str, now: str) -> str:
    diff = difflib.unified_diff(stored.splitlines(), now.splitlines(), "stored", "now", n=0, lineterm="")
    return "\n".join(list(diff)[:12])


def listing_problems(nb: dict, name: str) -> list[str]:
    """Every stale or uncheckable source listing in notebook `nb`, as messages saying what to do."""
    cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
    problems, namespace = [], None
    for cell in cells:
        where = f"{name}, cell id {cell.get('id', '?')}"
        code = _code(cell)
        if "getsource" not in code:
            continue
        statements = ast.parse(code).body
        listed = [_listed_expression(s) for s in statements]
        if not statements or None in listed:
            problems.append(f"{where} prints source in a form this check cannot verify: {CONVENTION}")
            continue
        if not cell.get("outputs"):
            continue                  # shown without a stored output: nothing can be stale
        if namespace is None:
            namespace = _imports(cells)
        now = []
        for expr in listed:
            try:
                obj = eval(compile(ast.Expression(expr), "<listing>", "eval"), dict(namespace))
            except Exception as e:
                problems.append(f"{where} lists `{ast.unparse(expr)}`, which the notebook's imports "
                                f"do not reach ({type(e).__name__}: {e}): list package code by an "
                                "imported name")
                break
            now.append(inspect.getsource(obj) + "\n")
        else:
            stored = _stored_stdout(cell)
            if stored != "".join(now):
                names = ", ".join(ast.unparse(e) for e in listed)
                problems.append(f"{where}: the stored listing of {names} is stale (it is not "
                                "inspect.getsource of the code now); re-execute the notebook\n"
                                + _first_difference(stored, "".join(now)))
    return problems


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_stored_source_listings_are_the_current_source(path):
    problems = listing_problems(json.loads(path.read_text()), path.name)
    assert not problems, "\n\n".join(problems)


# ---- the test of the test -------------------------------------------------------------------
def _notebook_listing(expr: str = "mappings._Copy") -> dict:
    """A two-cell notebook as nbconvert stores it: an import cell and a fresh listing of `expr`."""
    from minitron.tensor_parallel import mappings
    stored = inspect.getsource(eval(expr, {"mappings": mappings})) + "\n"
    code = lambda src, outputs: {"cell_type": "code", "id": "c", "source": [src], "outputs": outputs}
    return {"cells": [
        code("import inspect\nfrom minitron.tensor_parallel import mappings\n", []),
        code(f"print(inspect.getsource({expr}))\n",
             [{"output_type": "stream", "name": "stdout", "text": stored.splitlines(keepends=True)}]),
    ]}


def test_a_planted_stale_listing_is_caught():
    nb = _notebook_listing()
    assert listing_problems(nb, "lesson") == []
    cell = nb["cells"][1]
    out = cell["outputs"][0]
    text = "".join(out["text"])
    # The listing as it was before the code changed: one `return` line edited since it was stored.
    old_line = next(ln for ln in text.splitlines() if ln.strip().startswith("return "))
    planted = old_line.replace("return ", "return None if ctx is None else ", 1)
    out["text"] = text.replace(old_line, planted, 1)
    problems = listing_problems(nb, "lesson")
    assert len(problems) == 1, problems
    assert "is stale" in problems[0] and "re-execute the notebook" in problems[0]
    assert f"-{planted}" in problems[0] and f"+{old_line}" in problems[0], problems[0]
    # A listing cell without stored output shows nothing stale: accepted.
    cell["outputs"] = []
    assert listing_problems(nb, "lesson") == []


def test_a_listing_outside_the_convention_is_reported():
    nb = _notebook_listing()
    nb["cells"][1]["source"] = ["print(inspect.getsource(mappings._Copy)[:200])\n"]
    problems = listing_problems(nb, "lesson")
    assert len(problems) == 1 and "cannot verify" in problems[0], problems


def test_a_listing_of_a_name_the_imports_do_not_reach_is_reported():
    nb = _notebook_listing()
    nb["cells"][1]["source"] = ["print(inspect.getsource(defined_in_a_cell))\n"]
    problems = listing_problems(nb, "lesson")
    assert len(problems) == 1 and "`defined_in_a_cell`" in problems[0], problems
    assert "NameError" in problems[0]
