"""What both port stress tests share: running a script again inside a network namespace of its
own (`unshare -n`, so root) whose ephemeral port range is narrow, so ports are reused quickly,
and the command line that dispatches between the script's three roles."""
import os
import subprocess
import sys
from typing import Callable


def rerun_inside(script: str, port_range: str) -> int:
    """Run `python script --inside` in a fresh network namespace with only loopback up and these
    ephemeral ports; its exit code (2 when unshare is missing)."""
    here = os.path.abspath(script)
    shell = (f'ip link set lo up && echo "{port_range}" > /proc/sys/net/ipv4/ip_local_port_range '
             f'&& exec "{sys.executable}" "{here}" --inside')
    try:
        return subprocess.run(["unshare", "-n", "sh", "-c", shell]).returncode
    except FileNotFoundError:
        print("unshare not found (util-linux); this stress test needs it and root", file=sys.stderr)
        return 2


def main(script: str, port_range: str, inside: Callable[[], int], helper_flag: str,
         helper: Callable[[], None]) -> int:
    """`script`: re-run inside a namespace; `script --inside`: the stress test (1 if any failed);
    `script <helper_flag>`: one of the processes it starts beside the others."""
    if sys.argv[1:] == [helper_flag]:
        helper()
        return 0
    if sys.argv[1:] == ["--inside"]:
        return 1 if inside() else 0
    return rerun_inside(script, port_range)
