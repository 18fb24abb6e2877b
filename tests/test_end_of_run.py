"""Under torchrun a rank that aborted at exit ("terminate called without an active exception",
a gloo thread still alive while the interpreter tore down) made torchrun kill rank 0 before it
wrote the summary, the sample and loss.png. The fix (runtime/process_group.end_of_run and
train/__main__.py): every process waits until all have finished, tears its group down, and then
leaves with os._exit, skipping the interpreter's teardown. These tests keep each piece."""
import os
import runpy
import subprocess
import sys
import textwrap

import pytest
import torch.distributed as dist

from minitron.runtime import process_group

TORCHRUN_ENV = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def _record_teardown(monkeypatch) -> list[str]:
    calls: list[str] = []
    alive = [True]
    monkeypatch.setattr(dist, "is_initialized", lambda: alive[0])
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: calls.append("barrier"))

    def destroy(*a, **k):
        calls.append("destroy")
        alive[0] = False
    monkeypatch.setattr(dist, "destroy_process_group", destroy)
    return calls


def test_end_of_run_waits_for_every_rank_before_tearing_down(monkeypatch):
    calls = _record_teardown(monkeypatch)
    for k in TORCHRUN_ENV:
        monkeypatch.delenv(k, raising=False)
    process_group.end_of_run()
    assert calls == []                       # launch() forks and tears down its own ranks
    for k, v in TORCHRUN_ENV.items():
        monkeypatch.setenv(k, v)
    process_group.end_of_run()
    # the barrier first: a rank that tore down (and left) before rank 0 finished writing is
    # what torchrun answered by killing rank 0
    assert calls == ["barrier", "destroy"]
    process_group.end_of_run()               # a second call finds no group: nothing more
    assert calls == ["barrier", "destroy"]


class _Exited(Exception):
    pass


@pytest.mark.parametrize("torchrun", [True, False], ids=["torchrun", "plain"])
def test_train_leaves_without_the_interpreters_teardown_under_torchrun(monkeypatch, torchrun):
    import minitron.train.cli as cli
    monkeypatch.setattr(cli, "main", lambda: 3)

    def os_exit(code):
        raise _Exited(("os._exit", code))
    monkeypatch.setattr(os, "_exit", os_exit)
    for k, v in TORCHRUN_ENV.items():
        if torchrun:
            monkeypatch.setenv(k, v)
        else:
            monkeypatch.delenv(k, raising=False)
    with pytest.raises((_Exited, SystemExit)) as e:
        runpy.run_module("minitron.train.__main__", run_name="__main__")
    if torchrun:      # os._exit: no atexit handlers, no static destructors of gloo's threads
        assert e.type is _Exited and e.value.args[0] == ("os._exit", 3)
    else:             # a plain run exits as any script does
        assert e.type is SystemExit and e.value.code == 3


# Rank 0 writes its files late; rank 1 must not get past end_of_run before they are written.
SCRIPT = """
    import os, sys, time
    import torch.distributed as dist
    import minitron
    from minitron.runtime.process_group import end_of_run

    minitron.launch(lambda: dist.get_rank(), world_size=2)
    out = sys.argv[1]
    if dist.get_rank() == 0:
        time.sleep(1.0)
        open(out, "w").write("summary")
    end_of_run()
    line = f"rank {os.environ['RANK']} sees summary={os.path.exists(out)} group={dist.is_initialized()}"
    os.write(1, (line + "\\n").encode())
    os._exit(0)
"""


def test_under_torchrun_no_rank_leaves_before_rank_0_has_written(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script), str(tmp_path / "summary.txt")], capture_output=True, text=True, timeout=120,
        env=env)
    assert proc.returncode == 0, proc.stderr
    lines = sorted(ln for ln in proc.stdout.splitlines() if ln.startswith("rank "))
    assert lines == ["rank 0 sees summary=True group=False", "rank 1 sees summary=True group=False"]
