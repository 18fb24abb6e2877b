"""Stress: many forked launches at once must never take each other's rendezvous port.

    python tests/stress/launch_port_race.py          # needs root (a network namespace)

It re-runs itself inside a network namespace of its own (`unshare -n`) whose ephemeral port
range is narrow (40000-40300), so ports are reused quickly, and there runs PARALLEL scripts side
by side, each doing LAUNCHES `minitron.launch(f, world_size=2)` one after another. A rendezvous
that chooses a port before it binds it (bind port 0, close, hand the number on) loses that port
to a neighbour's socket now and then; one that binds as it chooses never does. Prints how many
launches failed and exits 1 if any did. Kept out of `make test` (root); .ci/run runs it."""
import subprocess
import sys
import time

import namespace

PARALLEL, LAUNCHES, WORLD = 4, 25, 2
PORT_RANGE = "40000 40300"


def _ranks_agree(x):
    import torch
    from minitron.runtime import comm
    t = torch.tensor([float(x)])
    comm.all_reduce(t, comm.Group("world", range(WORLD)))
    return t.item()


def _gist(error: str) -> str:
    """The first line of a RankError and the last line of the rank's traceback in it."""
    lines = [line for line in error.strip().splitlines() if line.strip()]
    raised = [line for line in lines if not line.startswith(" ") and line is not lines[0]
              and not line.startswith("The other ranks")]
    return " | ".join(lines[:1] + raised[-1:])[:400]


def one_script() -> int:
    """LAUNCHES launches one after another; print one line per failure; return the count."""
    import minitron
    failed = 0
    for k in range(LAUNCHES):
        try:
            got = minitron.launch(_ranks_agree, k, world_size=WORLD, backend="gloo", timeout=60,
                                  echo=False)
            assert got == [float(k * WORLD)] * WORLD, got
        except Exception as e:   # noqa: BLE001 -- every failure is counted and shown
            failed += 1
            print(f"launch {k} failed: {_gist(str(e))}", flush=True)
    return failed


def inside_namespace() -> int:
    """PARALLEL scripts side by side; the total count of failed launches."""
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, __file__, "--one"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(PARALLEL)]
    failed = 0
    for p in procs:
        out, _ = p.communicate()
        lines = out.strip().splitlines()
        failed += int(lines[-1]) if lines and lines[-1].isdigit() else LAUNCHES
        sys.stdout.write("".join(f"  {line}\n" for line in lines[:-1]))
        if p.returncode != 0:
            print(f"  a script exited with {p.returncode}")
    total = PARALLEL * LAUNCHES
    print(f"{failed} of {total} launches failed ({PARALLEL} scripts x {LAUNCHES} launches of "
          f"world_size={WORLD}, ephemeral ports {PORT_RANGE}, {time.monotonic() - start:.0f} s)")
    return failed


if __name__ == "__main__":
    sys.exit(namespace.main(__file__, PORT_RANGE, inside_namespace, "--one", lambda: print(one_script())))
