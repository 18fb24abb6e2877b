"""python -m minitron.verify (minitron/verify/cli.py)."""
import os
import sys

from ..runtime.process_group import end_of_run, under_torchrun
from .cli import main

code = main()
if under_torchrun():    # every process leaves together, without the interpreter's teardown
    end_of_run()        # (process_group.end_of_run: a gloo thread can abort it at exit)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)
