"""Run a graded notebook's cells in a kernel of their own, and bring back only data.

The kernel holds the learner's code, so nothing it says is trusted except as data: for each
cell, the status of its execute_reply ("ok" or not), the exception it reported, its printed
text (shown to the learner, never compared) and the values its `show` calls published
(minitron/grade/values.py), parsed as plain JSON by jupyter_client in this process. Only the
messages answering this cell's request count, and only until the kernel says it is idle.

The kernel runs in a throwaway copy of the course's package (course_copy.py), with its working
folder there and an environment that names no file of the course. When the grader runs as root
the kernel runs without any capability (setpriv): it can then neither read this process's
memory nor its folder or open files through /proc (this process is not dumpable, see cli.py),
nor read or write files of other users. Given `user`, it runs as that user instead (grading
for credit: a user that may run this Python and owns nothing of the course). The kernel is a
fork of the fork server (forkserver.py), started the same way, which has imported torch: the
start the kernel would have had, less 1.8 s of CPU.
"""
from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty

from jupyter_client import KernelManager
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
from jupyter_client.provisioning import LocalProvisioner

from minitron.grade.forkserver import ForkServer, server_for

from minitron.grade.judge import Shown
from minitron.grade.values import VALUE_MIME



@dataclass
class CellRun:
    """What one cell's run left, as data."""
    status: str                      # "ok", "error", "aborted", "timeout", "died", "not run"
    shown: list[Shown] = field(default_factory=list)
    ename: str = ""
    evalue: str = ""
    traceback: list[str] = field(default_factory=list)
    text: str = ""                   # what it printed: for the learner's eyes only
    bad_value: str = ""              # a published value that was not plain shown data
    exit_code: int | None = None     # status "died": the kernel process's exit status


def kernel_python(home: Path) -> str:
    """This Python, under a name in the throwaway folder: `make setup` puts the virtual
    environment inside the course (.venv), and the kernel's command line would name it. A
    virtual environment is a pyvenv.cfg beside bin/: its copy names only the base interpreter,
    and lib/ links to this one's packages. (Their editable install still points at the course:
    for credit, grade with minitron installed as a package, `pip install .`.)"""
    real = os.path.realpath(sys.executable)
    if sys.prefix == sys.base_prefix:
        return real
    env = home / ".python"
    if (env / "pyvenv.cfg").exists():   # made for an earlier try at starting this kernel
        return str(env / "bin" / "python")
    (env / "bin").mkdir(parents=True, exist_ok=True)
    (env / "bin" / "python").symlink_to(real)
    (env / "lib").symlink_to(Path(sys.prefix) / "lib")
    (env / "pyvenv.cfg").write_text(f"home = {os.path.dirname(real)}\n"
                                    "include-system-site-packages = false\n"
                                    f"version = {'.'.join(map(str, sys.version_info[:3]))}\n")
    return str(env / "bin" / "python")


class _ThisPython(KernelSpecManager):
    """The kernel is this Python (the grader's environment), whatever kernels Jupyter knows,
    started through `prefix` (setpriv, see confinement)."""
    prefix: list[str] = []
    python: str = sys.executable

    def get_kernel_spec(self, kernel_name):
        return KernelSpec(argv=[*self.prefix, self.python, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                          display_name="Python 3", language="python", env={})


class _ForkedProvisioner(LocalProvisioner):
    """Starts the kernel as a fork of the fork server (forkserver.py) instead of a new process."""
    server: ForkServer | None = None

    async def launch_kernel(self, cmd: list[str], **kwargs):
        at = cmd.index("ipykernel_launcher")       # _ThisPython's: [setpriv ...] python -m ipykernel_launcher
        self.process = self.server.fork(cmd[at + 1:], env=kwargs["env"], cwd=str(kwargs["cwd"]))
        self.pid = self.pgid = self.process.pid     # it leads a session of its own
        self.cwd = kwargs["cwd"]
        return self.connection_info


class _Manager(KernelManager):
    """A kernel manager whose connection file the kernel's user can read."""
    owner: tuple[int, int] | None = None

    def write_connection_file(self, **kwargs):
        super().write_connection_file(**kwargs)
        if self.owner:
            os.chown(self.connection_file, *self.owner)


def kernel_user(name: str | None) -> tuple[int, int] | None:
    """(uid, gid) of the user to run kernels as; None: this process's own."""
    if not name:
        return None
    entry = pwd.getpwnam(name)
    return entry.pw_uid, entry.pw_gid


def confinement(user: tuple[int, int] | None) -> list[str]:
    """The command that starts the kernel without privileges: as root, setpriv dropping every
    capability (and switching to `user` when given); as anyone else, nothing (a kernel of the
    same user is kept out of this process by its being non-dumpable)."""
    if os.geteuid() != 0:
        if user and user[0] != os.geteuid():
            raise RuntimeError("only root can run the kernels as another user")
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        raise RuntimeError("grading as root needs setpriv (util-linux) to start kernels without privileges")
    who = ["--reuid", str(user[0]), "--regid", str(user[1]), "--clear-groups"] if user else []
    return [setpriv, *who, "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]


def base_env() -> dict[str, str]:
    """This process's environment less anything that names the course or this process's folder:
    what every kernel of this grader has in common (the fork server's key)."""
    course = os.path.realpath(Path(__file__).resolve().parents[2])
    others = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
              if p and os.path.realpath(p) != course]
    hidden = [course] + ([os.getcwd()] if os.getcwd().count(os.sep) > 1 else [])
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_", "MINITRON_GRADE", "JPY_", "JUPYTER_", "IPYTHONDIR"))
           and k not in ("PWD", "OLDPWD", "PYTHONPATH") and not any(h in v for h in hidden)}
    if others:
        env["PYTHONPATH"] = os.pathsep.join(others)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def home_env(home: Path) -> dict[str, str]:
    """base_env with the caches and settings of the tools a check uses kept in `home`."""
    return {**base_env(), "HOME": str(home), "IPYTHONDIR": str(home / ".ipython"),
            "MPLCONFIGDIR": str(home / ".matplotlib"), "XDG_CACHE_HOME": str(home / ".cache"),
            "TRITON_CACHE_DIR": str(home / ".triton"), "TORCHINDUCTOR_CACHE_DIR": str(home / ".inductor"),
            "JUPYTER_RUNTIME_DIR": str(home / ".runtime")}


def kernel_env(copy: Path, home: Path) -> dict[str, str]:
    """This process's environment with the course's package replaced by the copy's, and the
    caches and settings of the tools a check uses kept in the throwaway folder."""
    env = home_env(home)
    env["PYTHONPATH"] = os.pathsep.join([str(copy), *filter(None, [env.get("PYTHONPATH")])])
    return env


class Kernel:
    """One kernel for one graded notebook: start it, run cells one at a time, stop it."""

    def __init__(self, copy: Path, cwd: Path, home: Path, user: tuple[int, int] | None,
                 startup_timeout: float = 120):
        specs = _ThisPython()
        specs.prefix = confinement(user)
        specs.python = kernel_python(home)
        self.km = _Manager(kernel_spec_manager=specs, kernel_name="python3")
        self.km.owner = user
        self.km.connection_file = str(home / "kernel.json")
        # Unix sockets in the throwaway folder, not TCP ports: a port picked free can be taken
        # by another process before the kernel binds it (it died starting, under a loaded CI).
        self.km.transport, self.km.ip = "ipc", str(home / "kernel-ipc")
        self.server = server_for(specs.prefix, kernel_python, home_env, tuple(sorted(base_env().items())))
        self.km.kernel_id = str(uuid.uuid4())
        self.km.provisioner = _ForkedProvisioner(kernel_id=self.km.kernel_id, kernel_spec=self.km.kernel_spec,
                                                 parent=self.km)
        self.km.provisioner.server = self.server
        self.km.start_kernel(cwd=str(cwd), env=kernel_env(copy, home), stdout=open(os.devnull, "w"),
                             stderr=open(os.devnull, "w"))
        self.kc = self.km.client()
        # No heartbeat channel: a client made by its KernelManager asks the manager whether the
        # kernel's process lives (KernelClient._async_is_alive), and jupyter_client's heartbeat
        # thread, stopped before it has marked itself running (a kernel that dies starting),
        # reopens its socket in a loop until zmq runs out of sockets ("Too many open files",
        # seen in a suite run).
        self.kc.start_channels(hb=False)
        try:
            self.kc.wait_for_ready(timeout=startup_timeout)
        except RuntimeError:  # died starting: free its channels and ports before anyone tries again
            with contextlib.suppress(Exception):
                self.stop()
            raise
        self.dead = False

    def _exit_code(self) -> int | None:
        process = getattr(getattr(self.km, "provisioner", None), "process", None)
        return getattr(process, "returncode", None)

    def run(self, source: str, timeout: float) -> CellRun:
        """Run one cell; its status, exception, text and shown values."""
        if self.dead:
            return CellRun("not run")
        self.server.check()   # ForkServerGone: a kernel ended it, this run grades no one
        msg_id = self.kc.execute(source, store_history=True, allow_stdin=False, stop_on_error=False)
        run, idle, reply = CellRun("timeout"), False, None
        deadline = time.monotonic() + timeout
        while not (idle and reply is not None):
            left = deadline - time.monotonic()
            if left <= 0:  # the kernel may still be running it: no later cell runs there
                self.dead = True
                return run if reply is None else _with_reply(run, reply)
            got = False
            if not idle:
                try:
                    msg = self.kc.get_iopub_msg(timeout=min(0.2, left))
                    got = True
                    if msg.get("parent_header", {}).get("msg_id") == msg_id:
                        idle = _take(run, msg) or idle
                except Empty:
                    pass
            if reply is None:
                try:
                    msg = self.kc.get_shell_msg(timeout=0 if got else min(0.2, left))
                    if msg.get("parent_header", {}).get("msg_id") == msg_id and msg["msg_type"] == "execute_reply":
                        reply = msg
                except Empty:
                    pass
            if not got and not self.km.is_alive():
                self.server.check()
                self.dead = True
                run.status, run.exit_code = "died", self._exit_code()
                return run
        self.server.check()
        return _with_reply(run, reply)

    def stop(self):
        try:
            self.kc.stop_channels()
        finally:
            self.km.shutdown_kernel(now=True)


def _take(run: CellRun, msg: dict) -> bool:
    """Add an iopub message of this cell to its run; True when the kernel says it is idle."""
    kind, content = msg["msg_type"], msg.get("content", {})
    if kind == "status":
        return content.get("execution_state") == "idle"
    if kind == "stream":
        run.text += str(content.get("text", ""))
    elif kind in ("display_data", "execute_result"):
        data = content.get("data", {})
        if VALUE_MIME in data:
            try:
                run.shown.append(Shown.from_data(data[VALUE_MIME]))
            except ValueError as e:
                run.bad_value = run.bad_value or str(e)
        elif "text/plain" in data:
            run.text += str(data["text/plain"]) + "\n"
    elif kind == "error":
        run.ename, run.evalue = str(content.get("ename", "")), str(content.get("evalue", ""))
        run.traceback = [str(t) for t in content.get("traceback", [])]
    return False


def _with_reply(run: CellRun, reply: dict) -> CellRun:
    content = reply.get("content", {})
    run.status = content.get("status") if content.get("status") in ("ok", "error", "aborted") else "unknown"
    if run.status == "error" and not run.ename:
        run.ename, run.evalue = str(content.get("ename", "")), str(content.get("evalue", ""))
        run.traceback = [str(t) for t in content.get("traceback", [])]
    return run
