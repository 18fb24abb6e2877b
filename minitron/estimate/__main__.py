"""python -m minitron.estimate (minitron/estimate/cli.py)."""
import sys

from .cli import main

sys.exit(main())
