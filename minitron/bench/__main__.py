"""python -m minitron.bench (minitron/bench/cli.py)."""
import sys

from .cli import main

sys.exit(main())
