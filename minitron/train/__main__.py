"""python -m minitron.train (minitron/train/cli.py)."""
import os
import sys

from ..runtime.process_group import under_torchrun
from .cli import main

code = main()
if under_torchrun():    # leave without the interpreter's teardown (process_group.end_of_run)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)
