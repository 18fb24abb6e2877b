"""What a launched rank's output does in the parent: its prints are echoed in rank order; what
else it writes (warnings, logging, gloo and NCCL's C++ logs) is shown only when the run fails,
since nbval grades a notebook cell's stderr too (minitron/rank_output.py)."""
import contextlib
import logging
import os
import sys
import time
import warnings

import pytest
import torch.distributed as dist

import minitron
from preloaded_kernels import unix_sockets

SHORT = 3  # seconds: the collective timeout for the failure tests


def _print_late_first():
    # rank 0 prints last in time; the echo must still come in rank order
    time.sleep(0.3 * (dist.get_world_size() - 1 - dist.get_rank()))
    print(f"hello from {dist.get_rank()}")
    print("second line", file=sys.stderr)


def test_output_echoed_in_rank_order(capfd, monkeypatch):
    minitron.launch(_print_late_first, world_size=3, timeout=30)
    out, err = capfd.readouterr()
    assert out.splitlines() == [f"[rank {r}] hello from {r}" for r in range(3)]
    assert err == ""   # a successful run's stderr is not echoed (see the next tests)
    monkeypatch.setenv("MINITRON_SHOW_STDERR", "1")   # unless asked for
    minitron.launch(_print_late_first, world_size=3, timeout=30)
    out, err = capfd.readouterr()
    assert out.splitlines() == [f"[rank {r}] hello from {r}" for r in range(3)]
    assert [line for line in err.splitlines() if "second line" in line] == \
        [f"[rank {r}] second line" for r in range(3)]


def _warn_then(fail_on_rank):
    """Every way a rank's stderr fills up behind its back, then a print; one rank may raise."""
    warnings.warn("planted python warning", UserWarning)
    logging.getLogger("tests.planted").warning("planted logging warning")
    os.write(2, b"planted native line on fd 2\n")   # what gloo's and NCCL's C++ logs do
    os.write(1, b"planted native line on fd 1\n")
    print(f"result {dist.get_rank()}")
    if dist.get_rank() == fail_on_rank:
        raise KeyError("planted failure after the warnings")
    return dist.get_rank()


NOISE = ("planted python warning", "planted logging warning", "planted native line on fd 2",
         "planted native line on fd 1")


@contextlib.contextmanager
def notebook_cell(tmp_path, capfd):
    """A notebook cell's two streams: sys.stdout and sys.stderr are ipykernel streams there,
    which forward what a forked child writes to them into the cell. Files do the same here.
    Like torch at import, a library logger holds a handler on the cell's stderr.
    Yields read() -> (stdout, stderr) of the cell, descriptor-level writes included."""
    paths = {name: tmp_path / name for name in ("stdout", "stderr")}
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = (open(paths[name], "w", buffering=1) for name in ("stdout", "stderr"))
    logger = logging.getLogger("tests.planted")
    handler = logging.StreamHandler(sys.stderr)
    logger.addHandler(handler)
    logger.propagate = False

    def read():
        fd_out, fd_err = capfd.readouterr()
        return paths["stdout"].read_text() + fd_out, paths["stderr"].read_text() + fd_err
    try:
        yield read
    finally:
        logger.removeHandler(handler)
        logger.propagate = True
        sys.stdout.close(), sys.stderr.close()
        sys.stdout, sys.stderr = saved


def test_warnings_of_a_successful_run_stay_out_of_its_output(tmp_path, capfd):
    """nbval compares a cell's stderr: a library's warning must not fail every launch cell."""
    with notebook_cell(tmp_path, capfd) as cell:
        assert minitron.launch(_warn_then, None, world_size=2, timeout=30) == [0, 1]
    out, err = cell()
    assert out.splitlines() == ["[rank 0] result 0", "[rank 1] result 1"]
    assert err == ""


def test_a_failed_run_shows_the_warnings_and_the_traceback(tmp_path, capfd):
    with notebook_cell(tmp_path, capfd) as cell, pytest.raises(minitron.RankError) as info:
        minitron.launch(_warn_then, 1, world_size=2, timeout=SHORT)
    assert "rank 1 raised" in str(info.value) and "planted failure after the warnings" in str(info.value)
    out, err = cell()
    assert "[rank 1] result 1" in out.splitlines()
    for rank in (0, 1) if "[rank 0] result 0" in out else (1,):   # rank 0 may not have replied
        for noise in NOISE:
            assert any(line.startswith(f"[rank {rank}] ") and noise in line
                       for line in err.splitlines()), (rank, noise, err)


def _say_then_die_on_rank_1():
    if dist.get_rank() == 1:
        os.write(2, b"last words before dying\n")
        sys.stderr.write("and a python line, unflushed\n")   # sys.stderr is line-buffered
        os._exit(7)
    time.sleep(30)


def test_a_dead_rank_leaves_what_it_wrote(capfd):
    with pytest.raises(minitron.RankError, match="rank 1 died with exit code 7"):
        minitron.launch(_say_then_die_on_rank_1, world_size=2, timeout=SHORT)
    err = capfd.readouterr().err.splitlines()
    assert "[rank 1] last words before dying" in err and "[rank 1] and a python line, unflushed" in err


NOTEBOOK_CELLS = ['''
import logging, os, warnings
import torch.distributed as dist
import minitron

def work(fail_on_rank):
    warnings.warn("planted python warning")
    logging.getLogger("torch.distributed.planted").warning("planted torch log line")
    os.write(2, b"planted native line\\n")
    print("result", dist.get_rank())
    if dist.get_rank() == fail_on_rank:
        raise KeyError("planted failure")
''', "minitron.launch(work, None, world_size=2, timeout=30);",
    "minitron.launch(work, 1, world_size=2, timeout=30);"]


def test_in_a_real_notebook_only_a_failed_cell_has_stderr():
    """What nbval grades: the cell's streams in a Jupyter kernel (torch's logging handler holds
    the kernel's stderr there, and ipykernel forwards what forked ranks write to it)."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in NOTEBOOK_CELLS])
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3", allow_errors=True,
                            config=unix_sockets()).execute()
    _, ok, failed = ([(o.get("name", o.output_type), o.get("text", "") + "".join(o.get("traceback", [])))
                      for o in c.outputs] for c in nb.cells)
    assert ok == [("stdout", "[rank 0] result 0\n[rank 1] result 1\n")]
    streams = dict(failed[:-1])
    assert failed[-1][0] == "error" and "planted failure" in failed[-1][1]
    for noise in ("planted python warning", "planted torch log line", "planted native line"):
        assert any(line.startswith("[rank 1] ") and noise in line
                   for line in streams["stderr"].splitlines()), (noise, streams)
