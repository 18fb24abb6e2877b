"""Counting what minitron.runtime.comm sends: calls, payload bytes and ring wire bytes per
(group, operation). `with comm.counting() as c:` counts exactly what its block sends;
counters nest, and TOTAL counts everything this process has sent. The formulas for
payload and wire bytes are in comm.py's docstring, next to the operations."""
from __future__ import annotations

import contextlib
import dataclasses
from collections import defaultdict
from typing import Iterator


@dataclasses.dataclass
class Record:
    calls: int = 0
    bytes: int = 0          # payload, see comm.py's docstring
    wire_bytes: float = 0.0  # bytes this rank sends under a ring algorithm


class CommCounter:
    """Calls and bytes per (group name, operation) on this rank."""

    def __init__(self):
        self.records: dict[tuple[str, str], Record] = defaultdict(Record)

    def add(self, group: str, op: str, payload: int, wire: float) -> None:
        rec = self.records[(group, op)]
        rec.calls += 1
        rec.bytes += int(payload)
        rec.wire_bytes += float(wire)

    def _select(self, op=None, group=None):
        return [r for (g, o), r in self.records.items()
                if (op is None or o == op) and (group is None or g == group)]

    def calls(self, op: str | None = None, group: str | None = None) -> int:
        return sum(r.calls for r in self._select(op, group))

    def bytes(self, op: str | None = None, group: str | None = None) -> int:
        return sum(r.bytes for r in self._select(op, group))

    def wire_bytes(self, op: str | None = None, group: str | None = None) -> float:
        return sum(r.wire_bytes for r in self._select(op, group))

    def as_dict(self) -> dict:
        return {f"{g}/{o}": dataclasses.asdict(r) for (g, o), r in sorted(self.records.items())}

    def table(self) -> str:
        lines = [f"{'group':<10}{'operation':<16}{'calls':>7}{'payload bytes':>16}{'wire bytes':>14}"]
        for (g, o), r in sorted(self.records.items()):
            lines.append(f"{g:<10}{o:<16}{r.calls:>7}{r.bytes:>16,}{r.wire_bytes:>14,.0f}")
        return "\n".join(lines)


TOTAL = CommCounter()  # everything this process has sent since it started
_active: list[CommCounter] = [TOTAL]


@contextlib.contextmanager
def counting() -> Iterator[CommCounter]:
    """`with comm.counting() as c: ...` counts exactly what the block sends."""
    counter = CommCounter()
    _active.append(counter)
    try:
        yield counter
    finally:
        _active.remove(counter)
