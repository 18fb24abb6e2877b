"""Kernels forked from a process that has imported torch already, not each started afresh.

A graded notebook's kernel spends most of its start importing torch (about 1.8 s of CPU of the
2.1 s a kernel costs before its first cell; a bare kernel: 0.35 s), and the grader starts one
per notebook. So the kernels are forked from one process per grading environment, the fork
server: started like a kernel (the same confinement, a throwaway folder of its own, the same
environment less the package's path), it imports torch and IPython, makes itself non-dumpable
and then only forks. It runs no learner code; each kernel is a fresh fork of it that sets its
folder, environment and sys.path as its own start would have, becomes dumpable again and runs
ipykernel. What a kernel does never reaches the next one: it ends with its notebook.

A kernel can still signal its parent. If the fork server dies while the grader holds it, no
verdict of that run is trusted: ForkServerGone ends the grading (the grader's own death does
the same, a kernel that kills it passes no one)."""
from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

# Run as `python -c SERVER module...` (the modules to import first): its command line, which a
# forked kernel shows as its own, names no file. Protocol: one JSON line per request on stdin ({"argv", "env", "cwd"}), answered by
# {"pid"} on stdout; {"exit", "code"} when a kernel ends (code as subprocess gives it).
SERVER = r'''
import ctypes, gc, importlib, json, os, runpy, select, signal, sys
# No collection while importing, then freeze what was imported (gc.freeze's documented pattern
# before forking): those objects live on, in the server and in every kernel, so the collector's
# walks over them were waste (starting this server took 3.1 CPU-s before, 1.7 now), and a kernel's
# own collections leave the pages it shares with the server alone. Frozen with them are the
# imports' own cyclic leftovers (8.8k objects of 495k), never freed.
gc.disable()
try:                  # PRELOAD's torch._dynamo imports triton: see there. No CUDA call here:
    import glob, torch    # a CUDA driver set up before fork is unusable in the forked kernels
    if torch.version.cuda is None or not glob.glob("/dev/nvidia[0-9]*"):
        os.environ["TRITON_INTERPRET"] = "1"
except Exception:
    pass
for name in sys.argv[1:]:
    try:
        __import__(name)
    except Exception:
        pass
gc.freeze()
gc.enable()
libc = ctypes.CDLL(None)
libc.prctl(4, 0, 0, 0, 0)                 # PR_SET_DUMPABLE 0: no kernel reads this process
own = os.environ.get("PYTHONPATH", "").split(os.pathsep)
base, server = [p for p in sys.path[1:] if p not in own], os.getpid()
wake_r, wake_w = os.pipe()
for fd in (wake_r, wake_w):
    os.set_blocking(fd, False)
signal.set_wakeup_fd(wake_w)
signal.signal(signal.SIGCHLD, lambda *a: None)
def say(msg):
    os.write(1, (json.dumps(msg) + "\n").encode())
def kernel(req):
    os.setsid()
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.close(wake_r); os.close(wake_w)
    libc.prctl(4, 1, 0, 0, 0)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"], JPY_PARENT_PID=str(server))
    sys.path[:] = [req["cwd"], *[p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p], *base]
    sys.dont_write_bytecode = bool(req["env"].get("PYTHONDONTWRITEBYTECODE"))
    importlib.invalidate_caches()
    sys.argv = ["", *req["argv"], f"--IPKernelApp.parent_handle={server}"]
    code = 1
    try:
        runpy.run_module("ipykernel_launcher", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        os._exit(code)
say({"ready": server})
pending = b""
while True:
    ready = select.select([0, wake_r], [], [])[0]
    if wake_r in ready:
        while os.read(wake_r, 512) == 512:
            pass
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if not pid:
                break
            say({"exit": pid, "code": os.waitstatus_to_exitcode(status)})
    if 0 in ready:
        data = os.read(0, 65536)
        if not data:
            break
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            pid = os.fork()
            if pid == 0:
                kernel(json.loads(line))
            say({"pid": pid})
'''


class ForkServerGone(Exception):
    """The fork server ended while the grader held it: a kernel ended it, so nothing of this
    run is graded (not a RuntimeError: the grader retries those, this ends the grading)."""


# torch._dynamo: a torch optimizer's first construction imports it (1.3 s of CPU), in the kernel
# or in each of a notebook's forked ranks. It imports triton, whose triton.jit decides between
# compiler and interpreter as it decorates, so on a machine without a GPU the server imports it
# under TRITON_INTERPRET=1, the only triton a kernel can run there (as tests/conftest.py does); a
# kernel's own environment, and so its own kernels' choice, is the request's.
PRELOAD = ("torch", "torch._dynamo", "IPython", "ipykernel.ipkernel", "jupyter_client.session")


class ForkServer:
    def __init__(self, prefix: list[str], python: str, env: dict[str, str], home: Path | None,
                 preload: tuple[str, ...] = PRELOAD):
        self.home = home
        self.proc = subprocess.Popen([*prefix, python, "-c", SERVER, *preload], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                                     cwd=str(home) if home else None, start_new_session=True)
        self.exits: dict[int, int] = {}
        self._started: list[int] = []
        self._lock, self._news = threading.Lock(), threading.Condition()
        first = json.loads(self.proc.stdout.readline() or "{}")
        if "ready" not in first:
            self.close()
            raise RuntimeError("the kernels' fork server did not start")
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self._news:
                if "pid" in msg:
                    self._started.append(msg["pid"])
                else:
                    self.exits[msg["exit"]] = msg["code"]
                self._news.notify_all()
        with self._news:
            self._news.notify_all()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def check(self) -> None:
        if not self.alive():
            for key in [k for k, v in _servers.items() if v is self]:
                del _servers[key]           # the next grading in this process starts another
            self.close()                    # its folder too: the exit closes only listed servers
            raise ForkServerGone(f"the kernels' fork server (pid {self.proc.pid}) was ended, by a kernel: "
                                 "no verdict of this grading run is trusted")

    def fork(self, argv: list[str], env: dict[str, str], cwd: str) -> "Forked":
        """A kernel: `python argv` with this environment and working folder."""
        with self._lock:
            self.check()
            self.proc.stdin.write((json.dumps({"argv": argv, "env": env, "cwd": cwd}) + "\n").encode())
            self.proc.stdin.flush()
            with self._news:
                if not self._news.wait_for(lambda: self._started or not self.alive(), timeout=60):
                    raise RuntimeError("the kernels' fork server did not answer")
                self.check()
                return Forked(self._started.pop(0), self)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self.home:
            shutil.rmtree(self.home, ignore_errors=True)


class Forked:
    """A forked kernel as jupyter_client's provisioner handles a Popen: poll, wait, signals."""
    stdin = stdout = stderr = None

    def __init__(self, pid: int, server: ForkServer):
        self.pid, self.server = pid, server

    @property
    def returncode(self) -> int | None:
        return self.server.exits.get(self.pid)

    def poll(self) -> int | None:
        if self.returncode is None and not self.server.alive():
            return self._gone()
        return self.returncode

    def _gone(self) -> int | None:
        """The server is dead: the kernel is an orphan, alive until it is a zombie or gone."""
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            state = "X"
        return -signal.SIGKILL if state in "ZX" else None

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.01)
        return self.poll()

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


# The fork servers started, one per environment their kernels get (the grader's, less what
# names the course, with the kernels' confinement): a test or a second grading in the same
# process that sets another environment gets a server of its own. Closed when this process ends.
_servers: dict = {}
_starting = threading.Lock()


def server_for(prefix: list[str], python_for, env_for, key) -> ForkServer:
    """The fork server for kernels started through `prefix` in the environment `key` names;
    python_for(home) and env_for(home) give its Python and environment as for a kernel."""
    with _starting:                        # two grader threads share one server
        found = _servers.get((tuple(prefix), key))
        if found is None:
            home = Path(tempfile.mkdtemp(prefix="minitron-forkserver-"))
            os.chmod(home, 0o755)
            found = _servers[(tuple(prefix), key)] = ForkServer(prefix, python_for(home), env_for(home), home)
    found.check()
    return found


@atexit.register
def _close_at_exit():
    while _servers:
        _servers.popitem()[1].close()
