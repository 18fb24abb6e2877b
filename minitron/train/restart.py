"""A run that survives a dead rank: python -m minitron.train --max-restarts N.

When a rank dies (killed, a segfault) or raises, the launcher stops every other rank at once
(runtime/launch.py: a death is seen on the process's sentinel, a raise on its reply; a rank
stuck in a collective its dead peer never joins times out within the launcher's deadline) and
raises RankError. Up to N times, `python -m minitron.train` then starts all ranks again from
the run's last complete checkpoint (saves are atomic, train/checkpoint.py: a rank killed
mid-save leaves the previous one as `latest`) and trains on. What a failure costs is the steps
since that checkpoint, run again.

The curve after a restart is the uninterrupted run's, step for step: a step's batch is a pure
function of (seed, step) (data.Loader.batch), its dropout masks of the step seed and the
global rows (tensor_parallel/random.py), its learning rate of the step, and the checkpoint
holds the weights and the whole optimizer state. metrics.jsonl keeps one row per step: the
rows past the checkpoint, those the restart runs again, are dropped first (out_dir.claim_out).

Where the restart continues from: checkpoints/latest in --out when it is later than where the
command started (its --resume, or step 0), else from where the command started. A diverged
loss (FloatingPointError) is not restarted: the same step would diverge again.

Under torchrun, restarting is torchrun's job (it restarts every process of the group):
    torchrun --standalone --nproc-per-node 8 --max-restarts 3 -m minitron.train ... --out runs/big
Each restarted process sees TORCHELASTIC_RESTART_COUNT > 0 and continues the same way, from
the latest checkpoint in --out (`continue_under_torchrun`), its process group rendezvousing
under that attempt's own prefix (runtime/process_group.py); --max-restarts of minitron.train
itself is refused there, as the two would restart each other's work. (Checked by hand on 2
gloo processes, a rank SIGKILLed at step 4: the same curve; too slow for the test suite.)
"""
from __future__ import annotations

import contextlib
import os
import sys

from . import checkpoint_manifest
from ..runtime.launch import RankError, launch, ranks_will_build_optimizers
from .out_dir import UsageError, claim_out

def launch_surviving(worker, args, mcfg, pcfg, describe=str):
    """launch(worker, args, mcfg, pcfg, progress fd) on every rank; after a RankError restart
    from the last checkpoint up to args.max_restarts times, saying so on stderr (`describe`:
    the error in one line). Raises the last RankError when none is left."""
    ranks_will_build_optimizers()      # after the flags chose how triton is imported
    while True:
        progress_fd = os.dup(sys.stderr.fileno())
        try:
            return launch(worker, args, mcfg, pcfg, progress_fd, world_size=pcfg.world_size)
        except RankError as e:
            diverged = "FloatingPointError" in str(e)     # a restart would diverge again
            if diverged or args.attempt >= args.max_restarts:
                raise
            where = prepare_restart(args)
            print(f"minitron.train: {describe(e)}; restart {args.attempt} of "
                  f"{args.max_restarts} from {where}", file=sys.stderr)
        finally:
            with contextlib.suppress(OSError):      # under torchrun the worker closed it
                os.close(progress_fd)


def torchrun_attempt() -> int:
    """How many times torchrun has restarted this process's group (0 outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def _latest(out: str) -> tuple[str, int] | None:
    """(path, step) of --out's checkpoints/latest, or None when there is none yet."""
    latest = os.path.join(out, "checkpoints", "latest")
    if not os.path.exists(latest):
        return None
    return latest, checkpoint_manifest.read_manifest(latest)["step"]


def start_of(args) -> None:
    """Remember where the command started, before any restart changes args.resume."""
    args.attempt = getattr(args, "attempt", torchrun_attempt())
    args.start = (args.resume, args.resume_step or 0)


def prepare_restart(args) -> str:
    """Point args at the checkpoint the next attempt continues from (see the module
    docstring), drop the metrics rows it will run again; returns where, in words."""
    args.attempt += 1
    latest = _latest(args.out)
    resume, step = args.start
    if latest is not None and latest[1] > step:
        resume, step = latest
    args.resume, args.resume_step, args.overwrite = resume, (step if resume else None), False
    if resume is None:       # from scratch: the worker rewrites metrics.jsonl
        return "step 0 (no checkpoint yet)"
    claim_out(args)
    return f"the checkpoint of step {step} ({os.path.realpath(resume)})"


def continue_under_torchrun(args) -> None:
    """A process that torchrun restarted: continue from --out's latest checkpoint when there is
    one later than the command's --resume (an earlier attempt wrote it), else start as the
    command did, replacing what the failed attempt left in --out."""
    if args.max_restarts:
        raise UsageError("--max-restarts under torchrun: torchrun restarts the processes "
                         "itself; pass torchrun --max-restarts N and drop minitron.train's")
    if torchrun_attempt() == 0:
        return
    latest = _latest(args.out)
    start = checkpoint_manifest.read_manifest(args.resume)["step"] if args.resume else 0
    if latest is not None and latest[1] > start:
        args.resume, args.overwrite = latest[0], False
    elif args.resume is None:
        args.overwrite = True            # the failed attempt's metrics, not another run's
