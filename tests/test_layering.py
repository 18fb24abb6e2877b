"""The package's floors (minitron/__init__.py's docstring): a file imports only from its own floor
or below, and no import circle, counting every import of every minitron/*.py, those inside
functions too. The floors are read from the docstring itself, so the written layering is the
one checked; the tests of the test plant a climbing import and a circle in a copy."""
from __future__ import annotations

import ast
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def floors(root: pathlib.Path) -> dict[str, int]:
    """{package, module or file: floor} from the docstring's lines `floor N  name name ...`."""
    doc = ast.get_docstring(ast.parse((root / "minitron" / "__init__.py").read_text())) or ""
    found = {}
    for n, names in re.findall(r"^\s*floor (\d+)((?:\s+[a-z_.]+)+)\s*$", doc, re.M):
        for name in names.split():
            found[name] = int(n)
    return found


def _module(root: pathlib.Path, path: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(root: pathlib.Path) -> dict[str, list[tuple[str, int]]]:
    """{module: [(minitron module it imports, line)]}: `from pkg import name` counts as an import
    of pkg.name where that is a module, else of pkg; at any depth of the file (functions too)."""
    paths = {_module(root, p): p for p in (root / "minitron").rglob("*.py")}

    def known(name: str) -> str:
        while name not in paths and "." in name:
            name = name.rsplit(".", 1)[0]
        return name

    found = {}
    for mod, path in paths.items():
        here = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        edges = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = (here[:len(here) - node.level + 1] if node.level else [])
                target = ".".join(base + ([node.module] if node.module else []))
                targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in paths else target
                           for a in node.names]
            else:
                continue
            edges += [(known(t), node.lineno) for t in targets
                      if t.split(".")[0] == "minitron" and known(t) != mod]
        found[mod] = edges
    return found


def floor_of(mod: str, table: dict[str, int]) -> int | None:
    """A file's own entry (pipeline.measure) before its package's (pipeline); minitron/__init__
    on the ground floor."""
    parts = mod.split(".")[1:]
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in table:
            return table[".".join(parts[:n])]
    return 0 if not parts else None


def climbing(root: pathlib.Path) -> list[str]:
    table, bad = floors(root), []
    for mod, edges in imports(root).items():
        for target, line in sorted(set(edges)):
            a, b = floor_of(mod, table), floor_of(target, table)
            if a is None or b is None:
                bad.append(f"{mod} (line {line}) -> {target}: not on any floor of minitron/__init__.py")
            elif b > a:
                bad.append(f"{mod} (floor {a}, line {line}) -> {target} (floor {b})")
    return bad


def circles(root: pathlib.Path) -> list[list[str]]:
    """Every strongly connected set of two or more modules (Tarjan), each sorted."""
    graph = {m: sorted({t for t, _ in e}) for m, e in imports(root).items()}
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_package_and_module_is_on_a_floor():
    table = floors(ROOT)
    assert len(set(table.values())) >= 5, table
    names = {p.stem if p.is_file() else p.name for p in (ROOT / "minitron").iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()}
    assert names <= set(table), f"not on any floor: {sorted(names - set(table))}"


def test_no_import_climbs_a_floor():
    assert climbing(ROOT) == []


def test_no_import_circles():
    assert circles(ROOT) == []


@pytest.fixture
def copy(tmp_path):
    shutil.copytree(ROOT / "minitron", tmp_path / "minitron",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_a_planted_climbing_import_is_caught(copy):
    grid = copy / "minitron" / "grid" / "groups.py"
    grid.write_text(grid.read_text() + "\n\ndef planted():\n    from ..train.engine import TrainingRun\n")
    assert [c for c in climbing(copy) if c.startswith("minitron.grid.groups ")] == \
        [f"minitron.grid.groups (floor 0, line {len(grid.read_text().splitlines())}) -> "
         f"minitron.train.engine (floor {floors(copy)['train']})"]


def test_a_planted_circle_is_caught(copy):
    actions = copy / "minitron" / "pipeline" / "actions.py"      # executor imports actions
    actions.write_text(actions.read_text() + "\n\ndef planted():\n    from . import executor\n")
    found = [c for c in circles(copy) if "minitron.pipeline.actions" in c]
    assert found and "minitron.pipeline.executor" in found[0], circles(copy)


def test_the_commands_start_without_torch_distributed_checkpoint():
    """`python -m minitron.verify` saves no checkpoint, nor does `python -m minitron.train
    --save-every 0`; importing torch.distributed.checkpoint at their start (through train.flags
    and train.restart, for --resume's manifest checks) cost each about a second (--help: 2.7-3.1 s
    for the verifier, 1.9-2.2 s without it). The train command imports it before its ranks fork,
    when it will save or resume. A fresh interpreter: this one has imported it already."""
    probe = ("import sys, minitron.verify.cli, minitron.train.cli; "
             "print(sorted(m for m in sys.modules if 'distributed.checkpoint' in m))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
