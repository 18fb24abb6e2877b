"""What a launched rank sends back: its result and its prints to the parent, the rest to a log.

A notebook grades a cell's stdout and stderr. The prints of a rank are part of the lesson and
are echoed by the parent in rank order. What libraries write (Python warnings, logging, the C++
logs of gloo and NCCL, which bypass Python and write to file descriptors 1 and 2) is not: a
new torch deprecation or macOS's hostname warning would otherwise change every graded cell. It
goes to one append-only file per rank, which the parent shows when the run fails.
"""
from __future__ import annotations

import io
import logging
import os
import pickle
import sys
import tempfile
import warnings
from typing import Any

import torch


def append_only_file() -> int:
    """An unnamed temporary file opened O_APPEND: the rank's writes always land at its end,
    whatever offset the parent reads at (the two share one open file description)."""
    handle, path = tempfile.mkstemp(prefix="minitron-rank-", suffix=".log")
    try:
        return os.open(path, os.O_RDWR | os.O_APPEND)
    finally:
        os.close(handle)
        os.unlink(path)


def read_log(fd: int) -> str:
    """Everything written to the log so far (pread: no offset moves under the rank's feet)."""
    return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")


def capture_output(log_fd: int) -> io.StringIO:
    """In a rank: sys.stdout into the returned string, everything else into the log.

    Descriptors 1 and 2 point at the log: in a notebook, ipykernel forwards them into the
    cell's output, where text from several ranks would interleave at random. sys.stderr is
    written line by line, so a rank that dies leaves everything it said."""
    parents = {id(s) for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)}
    for fd in (1, 2):
        os.dup2(log_fd, fd)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="backslashreplace",
                      closefd=False)
    sys.stdout = io.StringIO()
    # Warnings go to sys.stderr, whatever the parent did with them (pytest records them in a
    # list, which in this process nobody would ever read).
    warnings.showwarning = _warning_to_stderr
    # Logging handlers made in the parent still hold its streams (torch's own handler holds
    # the notebook's stderr, which ipykernel forwards from forked children into the cell).
    for handler in _all_handlers():
        if isinstance(handler, logging.StreamHandler) and id(handler.stream) in parents:
            handler.stream = sys.stderr
    return sys.stdout


def _warning_to_stderr(message, category, filename, lineno, file=None, line=None):
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def _all_handlers() -> list[logging.Handler]:
    loggers = [logging.getLogger(), *(obj for obj in logging.Logger.manager.loggerDict.values()
                                      if isinstance(obj, logging.Logger))]
    return [h for logger in loggers for h in logger.handlers]


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


class _CPUPickler(pickle.Pickler):
    """Results travel to the parent as CPU tensors: unpickling a CUDA tensor there would
    initialise CUDA in the parent, and after that no rank can be forked with a GPU."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
            return _same, (obj.detach().cpu(),)
        return NotImplemented


def dumps_for_parent(obj: Any) -> bytes:
    buffer = io.BytesIO()
    _CPUPickler(buffer).dump(obj)
    return buffer.getvalue()
