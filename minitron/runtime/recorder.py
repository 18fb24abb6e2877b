"""A measured timeline, collected only while someone asks for it.

Code that overlaps communication with compute (tensor_parallel/overlap.py's chunked rings,
pipeline/pairs.py's overlapped pairs) stamps what it does as rows (kind, label, start, end) on
time.perf_counter's clock, one clock for every process on a machine. A Recorder hands them to
every list opened by `recording()`, nested or not; with none open, a row costs one loop over an
empty list.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

Row = tuple[str, str, float, float]


class Recorder:
    def __init__(self):
        self._open: list[list[Row]] = []

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[Row]]:
        """`with recorder.recording() as rows:` collects every row recorded inside the block."""
        rows: list[Row] = []
        self._open.append(rows)
        try:
            yield rows
        finally:
            self._open.remove(rows)

    def record(self, kind: str, label: str, start: float, end: float) -> None:
        for rows in self._open:
            rows.append((kind, label, start, end))

    def __bool__(self) -> bool:
        """Whether anyone is recording."""
        return bool(self._open)
