"""nbval's kernels forked from one process that has imported torch and IPython already
(minitron/grade/forkserver.py, the grader's fork server), not each started afresh: a lesson's
kernel spent about 1.8 s of CPU importing them before its first cell. Installed in the nbval
process of tests/test_notebooks.py only; a learner's Jupyter starts its kernels as it always does.

A fork is the kernel its own start would have made: the environment, working folder and
sys.path jupyter_client gives it. Not preloaded: matplotlib, which picks its backend at import
from MPLBACKEND, set by ipykernel as the kernel starts; and minitron, which a lesson may import
only after setting TRITON_INTERPRET (triton decides at its first import).

Each kernel's five channels are Unix sockets in a folder of its own, not TCP ports: jupyter_client
picks a port free (binds port 0, closes it, hands the number on), and another process can take
it before the kernel binds it; the kernel then dies starting ("Kernel died before replying to
kernel_info", lesson 00 in a loaded run of this suite). The grader does the same
(minitron/grade/kernel.py)."""
import atexit
import os
import shutil
import tempfile

from jupyter_client.manager import KernelManager
from jupyter_client.provisioning.local_provisioner import LocalProvisioner

from minitron.grade.forkserver import ForkServer

PRELOAD = ("torch", "torch._dynamo", "numpy", "IPython", "ipykernel.ipkernel", "jupyter_client.session")


def unix_sockets():
    """A traitlets Config putting a KernelManager's channels on Unix sockets in a folder of its
    own (module docstring): nbval's kernels here, and the tests' through nbclient."""
    from traitlets.config import Config
    folder = tempfile.mkdtemp(prefix="nbval-kernel-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    config = Config()
    config.KernelManager.transport, config.KernelManager.ip = "ipc", os.path.join(folder, "ipc")
    return config


def start_new_kernel(startup_timeout=60, kernel_name="python", **kwargs):
    """nbval.kernel.start_new_kernel, with the channels on Unix sockets (module docstring)."""
    import nbval.kernel
    km = KernelManager(kernel_name=kernel_name, kernel_spec_manager=nbval.kernel.NbvalKernelspecManager(),
                       config=unix_sockets())
    km.start_kernel(**kwargs)
    kc = km.client()
    kc.start_channels(hb=False)     # as minitron/grade/kernel.py does, and why
    try:
        kc.wait_for_ready(timeout=startup_timeout)
    except RuntimeError:
        kc.stop_channels()
        km.shutdown_kernel()
        raise
    return km, kc


def pytest_configure(config):
    """As a plugin of nbval's pytest (pytest.main(..., plugins=[this module])): nbval is imported
    by then, so pytest has rewritten its asserts, and its kernels start here."""
    import nbval.kernel
    nbval.kernel.start_new_kernel = start_new_kernel


def install() -> None:
    servers: dict[str, ForkServer] = {}
    started_afresh = LocalProvisioner.launch_kernel

    async def launch_kernel(self, cmd, **kwargs):
        if cmd[1:3] != ["-m", "ipykernel_launcher"]:       # python -m ipykernel_launcher ...
            return await started_afresh(self, cmd, **kwargs)
        python = cmd[0]
        if python not in servers:
            servers[python] = ForkServer([], python, dict(os.environ), None, PRELOAD)
            atexit.register(servers[python].close)
        self.process = servers[python].fork(cmd[3:], env=kwargs["env"], cwd=str(kwargs.get("cwd") or os.getcwd()))
        self.pid = self.pgid = self.process.pid    # it leads a session of its own
        self.cwd = kwargs.get("cwd")
        return self.connection_info

    LocalProvisioner.launch_kernel = launch_kernel
