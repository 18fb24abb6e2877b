"""python -m minitron.train (minitron/train/cli.py)."""
import sys

from .cli import main

sys.exit(main())
