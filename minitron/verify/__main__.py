"""python -m minitron.verify (minitron/verify/cli.py)."""
import sys

from .cli import main

sys.exit(main())
