"""python -m minitron.plan [options]: minitron/estimate/plan_cli.py under its short name."""
import sys

from ..estimate.plan_cli import main

sys.exit(main())
