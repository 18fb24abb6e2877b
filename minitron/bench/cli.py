"""python -m minitron.bench MODE [options]: the modes, each in its own file (see __init__)."""
from __future__ import annotations

import sys

from . import __doc__ as BENCH_DOC


def overhead(argv: list[str]) -> int:
    from .overhead import overhead
    return overhead(argv)


def overlap(argv: list[str]) -> int:
    from .overlap import run
    return run(argv)


def dualpipev(argv: list[str]) -> int:
    from .dualpipev import run
    return run(argv)


def peers(argv: list[str]) -> int:
    from .peers import run
    return run(argv)


def kernels(argv: list[str]) -> int:
    try:
        from . import kernels as kernel_bench
    except ImportError as e:
        print(f"the kernel benchmarks are not installed (minitron/bench/kernels.py: {e})", file=sys.stderr)
        return 1
    return kernel_bench.run(argv) or 0


def precision(argv: list[str]) -> int:
    from .precision import run
    return run(argv)


def scaling(argv: list[str]) -> int:
    from .scaling import run
    return run(argv)


def gpu(argv: list[str]) -> int:
    from .gpu import main as gpu_check
    return gpu_check(argv)


COMMANDS = {"overhead": overhead, "overlap": overlap, "peers": peers, "kernels": kernels,
            "precision": precision, "scaling": scaling, "gpu": gpu, "dualpipev": dualpipev}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m minitron.bench {{{','.join(COMMANDS)}}} [options]\n\n{BENCH_DOC}",
              file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])
