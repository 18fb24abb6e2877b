"""The --out folder of python -m minitron.train: a run never silently replaces another.

--resume continues the run in --out (its metrics.jsonl keeps the rows up to the checkpoint's
step, then continues, so the plotted curve is the run's); --overwrite replaces it, saying what
it removes; without either an --out that holds a run is refused, naming both.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

RUN_FILES = ("metrics.jsonl", "loss.png", "checkpoints")


class UsageError(ValueError):
    """A bad command line: one line on stderr, exit code 2."""


def check_writable(out: str) -> None:
    """Create --out and write a file into it. The probe has a name of its own: torchrun's
    processes all probe at once, and one's remove must not take away another's file."""
    try:
        os.makedirs(out, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test.", dir=out)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise UsageError(f"cannot write to --out {out}: {e.strerror}") from None


def existing_run(out: str) -> list[str]:
    """What an earlier run left in `out` (an empty checkpoints folder does not count)."""
    found = [f for f in RUN_FILES if os.path.exists(os.path.join(out, f))]
    if "checkpoints" in found and not os.listdir(os.path.join(out, "checkpoints")):
        found.remove("checkpoints")
    return found


def check_replacing(args) -> None:
    """A run never silently replaces another: --resume continues it, --overwrite replaces it."""
    found = existing_run(args.out)
    if found and not (args.resume or args.overwrite):
        latest = os.path.join(args.out, "checkpoints", "latest")
        cont = f"--resume {latest} to continue it, " if os.path.exists(latest) else ""
        raise UsageError(f"--out {args.out} already holds a run ({', '.join(found)}): pass "
                         f"{cont}--overwrite to replace it, or another --out")


def claim_out(args) -> None:
    """One process (rank 0) makes --out ready: --overwrite removes the old run, saying what;
    --resume drops the metrics rows past the checkpoint, so the curve is this run's."""
    metrics = os.path.join(args.out, "metrics.jsonl")
    if args.overwrite:
        found = existing_run(args.out)
        if found:
            print(f"minitron.train: --overwrite: removing {', '.join(found)} from {args.out}",
                  file=sys.stderr)
        for name in found:
            path = os.path.join(args.out, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    elif args.resume and os.path.exists(metrics):
        try:
            kept = [line for line in open(metrics) if line.strip()
                    and json.loads(line)["step"] <= args.resume_step]
        except (ValueError, KeyError, TypeError):
            raise UsageError(f"{metrics} is not a metrics file of minitron.train: move it "
                             "away, or pass another --out") from None
        tmp = f"{metrics}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, metrics)


def read_metrics(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]
