"""Shared fixtures. Multi-process tests run on worker pools started once per session."""
import gc
import os
import sys

# jsonschema (nbformat's, imported by tests/test_grading.py) compiles a grammar at import for
# rfc3987_syntax, a string format no notebook schema uses: 1.3 s of CPU in each pytest process.
# Hidden here, before anything imports it; `make test` runs with -p no:nbval, whose plugin would
# import it before this file (the lessons' nbval processes load nbval, and hide it: test_notebooks).
sys.modules.setdefault("rfc3987_syntax", None)

import pytest
import torch

import minitron
# MINITRON_STRICT=1 (.ci/run): a skip fails unless this machine cannot run the test.
import strict_skips
from strict_skips import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401

# The files that take longest, longest first (each mostly one module fixture: nbval over every
# lesson, grading every solution, the sm_90 compiler over every kernel, the interpreter).
# `make test` runs whole files on 2-4 xdist workers, handed out in collection order
# (--no-loadscope-reorder): started first, these run side by side from the start and the short
# files fill in around them, instead of one starting when a worker frees up late in the run.
# The quick matrix's files (alone on 2 cores: 52 s clean, 35 s the plants' rows at one step,
# pytest's own timing) were collected near the end, alphabetically, where the last free worker
# could start them last.
LONG_POLES = ("test_notebooks.py", "test_grading.py", "test_verify_matrix.py",
              "test_verify_matrix_plants.py", "test_grading_tamper.py", "test_grading_repros.py",
              "test_kernels_compile.py", "test_model_kernels.py", "test_kernels.py")


@pytest.hookimpl(tryfirst=True, optionalhook=True)   # optional: pytest runs without xdist too
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (make test): a worker per CPU this process may use, plus one (without
    sched_getaffinity, as on macOS: xdist's own count). A worker often waits with its CPU idle:
    on ranks a test stops for hanging (test_launch.py: 63 s of wall time, 22 s of CPU), on
    kernels and nbval processes starting. On 2 cores the suite, Triton's cache empty, took 321 s
    with 2 workers, 280 s with 3, 305 s with 4 (one run each). PYTEST_XDIST_AUTO_NUM_WORKERS
    still decides when set; make test's --maxprocesses caps it."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None                       # xdist's own hook reads it
    return len(os.sched_getaffinity(0)) + 1 if hasattr(os, "sched_getaffinity") else None


def pytest_sessionstart(session):
    """What this process holds by now (torch, pytest) lives to its end: frozen, the cyclic
    collector stops walking it at every full collection (perf: the controller spent a third of
    its CPU there, the workers a tenth)."""
    gc.freeze()


def pytest_collection_finish(session):
    gc.freeze()      # an xdist worker collects after sessionstart: its 1600 tests live on too


def pytest_unconfigure(config):
    gc.unfreeze()    # for the collection at exit: frozen, triton's bindings report them as leaked


def pytest_collection_modifyitems(items):
    strict_skips.pytest_collection_modifyitems(items)
    first = {name: k for k, name in enumerate(LONG_POLES)}
    items.sort(key=lambda item: first.get(item.path.name, len(LONG_POLES)))   # stable: the rest as collected


def _import_triton_for_this_machine():
    """triton.jit picks interpreter or compiler when triton is first imported, for good.
    Without a GPU the kernels can only run interpreted, so make that first import happen
    here, under TRITON_INTERPRET=1, whichever test file is collected first."""
    if torch.cuda.device_count() > 0 or "TRITON_INTERPRET" in os.environ:
        return
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401
    except ImportError:
        pass
    finally:
        del os.environ["TRITON_INTERPRET"]


_import_triton_for_this_machine()
# A torch optimizer's first construction imports torch._dynamo (1.3 s of CPU), in every rank of a
# WorkerPool and of a worker's first launch. Imported here, after triton (it imports triton too),
# once per pytest process: every rank forked from it inherits it.
import torch._dynamo  # noqa: E402,F401
# Every multi-process test builds CPU tensors: gloo ranks even on a machine with GPUs.
os.environ.setdefault("MINITRON_BACKEND", "gloo")
# One torch thread here too, as every rank has: on the tests' tiny tensors a second thread only
# waits at each op's barrier for a core the ranks hold (tests/test_moe.py: 25 s of CPU, 20 s).
torch.set_num_threads(1)

_pools: dict[int, minitron.WorkerPool] = {}


@pytest.fixture(scope="session")
def run_ranks():
    """run_ranks(fn, *args, world_size=N) -> [result of rank 0, ..., rank N-1].

    fn must be a module-level function (it is pickled by name). One pool per world size
    lives for the whole session, so a test costs its own work, not process start-up.
    """
    def run(fn, *args, world_size: int, **kwargs):
        if world_size not in _pools:
            # gloo even on a GPU machine: these tests build CPU tensors and CPU references.
            _pools[world_size] = minitron.WorkerPool(world_size, backend="gloo", timeout=60)
        return _pools[world_size].run(fn, *args, **kwargs)

    yield run
    for pool in _pools.values():
        pool.close()
    _pools.clear()


def _compiled_kernel_modules() -> list[str]:
    return [name for name, mod in list(sys.modules.items()) if name.startswith("minitron.kernels.")
            and any(type(v).__name__ == "JITFunction" for v in vars(mod).values())]


@pytest.fixture(autouse=True)
def _no_compiled_kernels_left_behind():
    """Without a GPU, a kernel module imported while TRITON_INTERPRET was unset holds kernels
    compiled for a GPU (triton.jit decides at import), and model/fused.py then refuses
    use_kernels in this process. A test that leaves such modules behind (the verifier's CLI
    with its enable_kernels stubbed, say) must not decide what the next test on the same xdist
    worker can run: they are dropped after each test, to be imported again, under whatever
    the next one sets. TRITON_INTERPRET too goes back to what it was: enable_kernels sets it in
    this process for good, and left set it would send every later test's optimizer steps on the
    same worker through the interpreter (ops.fused_adamw_step reads it on every call)."""
    interpret = os.environ.get("TRITON_INTERPRET")
    yield
    if interpret is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = interpret
    if torch.cuda.device_count() == 0:
        for name in _compiled_kernel_modules():
            del sys.modules[name]


@pytest.fixture(autouse=True, scope="session")
def _quiet_env():
    os.environ.setdefault("PYTHONHASHSEED", "0")
    yield
