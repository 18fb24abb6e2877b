"""owner.name = value inside a block, the original back after it: how the plants (plants.py)
and the faults (faults.py) put their errors into the production code from outside."""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def patched(owner, name: str, value):
    """owner.name = value inside the block, the original back after it."""
    real = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, real)
