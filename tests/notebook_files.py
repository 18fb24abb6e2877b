"""Notebook files as the grading tests handle them: cleared of outputs, saved as JSON."""
import copy
import json
import pathlib


def cleared(nb: dict) -> dict:
    """A copy with every code cell's outputs and execution count removed."""
    nb = copy.deepcopy(nb)
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
    return nb


def save(nb: dict, path: pathlib.Path) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return path
