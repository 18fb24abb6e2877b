"""python -m minitron.grade (minitron/grade/cli.py)."""
import sys

from .cli import main

sys.exit(main())
