"""The course's package as the grader read it when it started, written out afresh for each
graded notebook: the kernel imports minitron from a throwaway copy, so whatever an answer
writes there is gone at the next notebook, and the course's own files are never on its path.

Each copy is written from the bytes read once, before any learner code ran, and their SHA-256
is recorded then: a copy is checked against it (`verify`) before its kernel starts.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path


class Pristine:
    """The package's files (minitron/**/*.py), read once."""

    def __init__(self, course: Path):
        self.files = {p.relative_to(course).as_posix(): p.read_bytes()
                      for p in sorted((course / "minitron").rglob("*.py")) if "__pycache__" not in p.parts}
        self.hashes = {k: hashlib.sha256(v).hexdigest() for k, v in self.files.items()}

    def write(self, owner: tuple[int, int] | None) -> "Throwaway":
        """A fresh folder holding the package, a working folder and a home for the kernel."""
        root = Path(tempfile.mkdtemp(prefix="minitron-graded-"))
        os.chmod(root, 0o755)  # the kernel's user must reach its copy; nothing secret is here
        course = root / "course"
        for rel, data in self.files.items():
            path = course / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        copy = Throwaway(root, course, course / "exercises", root / "home")
        copy.cwd.mkdir()
        copy.home.mkdir()
        self.verify(copy)
        if owner:
            for path in [root, *root.rglob("*")]:
                os.chown(path, *owner)
        return copy

    def verify(self, copy: "Throwaway") -> None:
        found = {p.relative_to(copy.course).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                 for p in copy.course.rglob("*.py")}
        if found != self.hashes:
            raise RuntimeError(f"the course copy in {copy.course} is not the package the grader read")


class Throwaway:
    def __init__(self, root: Path, course: Path, cwd: Path, home: Path):
        self.root, self.course, self.cwd, self.home = root, course, cwd, home

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
