"""Faults a run must survive: a rank that dies mid-run (train/restart.py restarts it) or mid-save
(train/checkpoint.py keeps the previous checkpoint). Each is a context manager that patches the
production code from outside while it is open; the ranks forked inside it inherit the patch.

    with rank_dies_at(step=3, rank=1, how="kill"):     # lesson 11, tests/test_restart.py
        cli.main([... "--max-restarts", "1"])
    with dies_mid_save("manifest"):                    # in the rank that should die
        checkpoint.save(path, model, engine, optimizer)
"""
from __future__ import annotations

import contextlib
import os
import signal

from ..train import checkpoint, restart
from ..train.engine import TrainingRun
from .patching import patched

HOW = ("kill", "raise")
SAVE_POINTS = ("written", "manifest")


@contextlib.contextmanager
def rank_dies_at(step: int, rank: int, how: str = "kill"):
    """Rank `rank` dies at the start of step `step` (0-based): SIGKILLed ("kill") or raising
    ("raise"), in the ranks of the first launch only, so a restarted run gets past it."""
    if how not in HOW:
        raise ValueError(f"how={how!r}: choose one of {HOW}")
    launches, launch, train_step = [], restart.launch, TrainingRun.step

    def counted(*args, **kwargs):          # in the launching process, before its ranks fork
        launches.append(1)
        return launch(*args, **kwargs)

    def step_or_die(run, tokens, targets, s):
        if len(launches) <= 1 and (s, run.grid.rank) == (step, rank):
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"a planted fault at step {s + 1} on rank {rank}")
        return train_step(run, tokens, targets, s)

    with patched(restart, "launch", counted), patched(TrainingRun, "step", step_or_die):
        yield


class _DiesAt:
    """A stand-in for a module checkpoint.py uses: the process exits (17) at its call of `name`,
    after the call (`after`) or instead of it; every other attribute is the module's."""

    def __init__(self, module, name: str, after: bool):
        self.module, self.name, self.after = module, name, after

    def __getattr__(self, attr):
        real = getattr(self.module, attr)
        if attr != self.name:
            return real

        def dies(*args, **kwargs):
            if self.after:
                real(*args, **kwargs)
            os._exit(17)
        return dies


def dies_mid_save(point: str):
    """This process dies inside checkpoint.save: "written" once dcp.save has written its files
    (before the manifest), "manifest" (rank 0 writes it) once the manifest is written, before
    the checkpoint is moved into place (its first os.rename)."""
    if point == "written":
        return patched(checkpoint, "dcp", _DiesAt(checkpoint.dcp, "save", after=True))
    if point == "manifest":
        return patched(checkpoint, "os", _DiesAt(os, "rename", after=False))
    raise ValueError(f"point={point!r}: choose one of {SAVE_POINTS}")
