"""Which torch a reference notebook's stored outputs were recorded with, and the one line a
learner sees when theirs differs (a printed figure may then differ for a right answer)."""
from __future__ import annotations

import json
from pathlib import Path


def recorded_torch(reference: dict) -> str | None:
    return reference.get("metadata", {}).get("minitron", {}).get("recorded_with", {}).get("torch")


def torch_version() -> str:
    import torch
    return torch.__version__.split("+")[0]


def stamp(path: Path, torch: str | None = None) -> None:
    """Record in a reference notebook which torch its stored outputs were produced with."""
    nb = json.loads(path.read_text())
    nb.setdefault("metadata", {}).setdefault("minitron", {})["recorded_with"] = {
        "torch": torch or torch_version()}
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False, sort_keys=True) + "\n")


def torch_line(references: dict[Path, dict]) -> str | None:
    """One line when this torch differs from the one a reference was recorded with."""
    mine = torch_version()
    recorded = {v for v in (recorded_torch(nb) for nb in references.values()) if v}
    other = sorted(v for v in recorded if v != mine)
    if not other:
        return None
    return (f"note: you have torch {mine}; the reference outputs were recorded with torch "
            f"{', '.join(other)}: a printed figure that depends on torch may differ from the "
            "reference for a right answer (verdicts should not)")
