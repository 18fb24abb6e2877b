"""Two torchrun agents on this machine play two nodes of two ranks each (c10d rendezvous on
127.0.0.1, gloo): `python -m minitron.train --tp 2 --dp 2` across them takes the same steps as
under minitron.launch's forked ranks, loss for loss. Every process has a deadline: a
rendezvous that never completes is killed, process group and all, and reported. The agents
meet at a store this process serves (rendezvous_store: its port is chosen by its bind, so no
other process can take it first); neither agent hosts one."""
import json
import os
import signal
import subprocess
import sys
import time

from minitron.runtime.process_group import rendezvous_store

TRAIN = ["-m", "minitron.train", "--tp", "2", "--dp", "2", "--steps", "3", "--hidden", "32",
         "--seq", "16", "--batch", "4", "--layers", "2", "--save-every", "0", "--sample", "0",
         "--eval-every", "3"]
DEADLINE = 120  # seconds for all three runs together


def _env():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MINITRON_BACKEND": "gloo", "MINITRON_TIMEOUT": "60"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _finish(procs: list[subprocess.Popen]) -> list[tuple[int, str, str]]:
    """Wait for every process within the deadline; on a timeout kill all of them (each leads
    its own process group: the agent and its workers) and show what they wrote to stderr."""
    end = time.monotonic() + DEADLINE
    try:
        outs = [p.communicate(timeout=max(0.1, end - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        outs = [p.communicate() for p in procs]
        raise AssertionError(f"not done within {DEADLINE} s: " + " | ".join(e[-2000:] for _, e in outs))
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


def _start(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env(), start_new_session=True)


def _losses(out: str) -> list[float]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f if line.strip()]


def test_two_torchrun_nodes_train_the_losses_of_one_forked_launch(tmp_path):
    store = rendezvous_store(DEADLINE)
    node = ["-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{store.port}",
            "--rdzv-conf", "is_host=false", "--rdzv-id", "two-nodes",
            "--local-addr", "127.0.0.1", "--max-restarts", "0"]
    runs = _finish([_start(node + TRAIN + ["--out", str(tmp_path / "nodes")]) for _ in range(2)]
                   + [_start(TRAIN + ["--out", str(tmp_path / "forked")])])   # all at once
    nodes, forked = runs[:2], runs[2:]
    for code, _, err in nodes + forked:
        assert code == 0, err[-3000:]
    losses = _losses(str(tmp_path / "forked"))
    assert len(losses) == 3 and _losses(str(tmp_path / "nodes")) == losses
    # the summary line comes from rank 0 alone, as in the forked run
    assert "".join(out for _, out, _ in nodes).count("loss ") == forked[0][1].count("loss ") == 1
