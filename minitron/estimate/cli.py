"""python -m minitron.estimate plan | memory | flops: the estimators' command lines, one file each."""
from __future__ import annotations

import sys

from . import __doc__ as ESTIMATE_DOC
from . import flops_cli, memory_cli, plan_cli

COMMANDS = {"plan": plan_cli.main, "memory": memory_cli.main, "flops": flops_cli.main}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m minitron.estimate {{{','.join(COMMANDS)}}} [options]\n\n{ESTIMATE_DOC}",
              file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])
