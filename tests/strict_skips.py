"""MINITRON_STRICT=1 (set by .ci/run): a skip is a failure unless this machine cannot run the test.

On CPU Linux everything in the suite can run: the kernels in Triton's interpreter, their
compilation for sm_90 (Triton ships its compiler), the multi-process tests on gloo. A skip
there means something broke (triton missing, a compiler API that moved, a kernel module loaded
the wrong way), and a green CI that skipped it would say nothing. So in strict mode every skip
fails, unless its reason is on the allowlist below *and* its condition holds on this machine:
"needs a GPU" is fine without one, not with one.

A skip at module level (pytest.importorskip at the top of a file) becomes one failing test
named after the module, so the rest of the suite still runs.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys

import pytest


def _gpu() -> bool:
    import torch   # here, not at the top: the self-test loads this plugin without the suite
    return torch.cuda.device_count() > 0


def _chromium() -> bool:
    return bool((shutil.which("chromium") or shutil.which("chromium-browser")) and shutil.which("chromedriver"))


def _pipelining_lacks(schedule: str) -> bool:
    try:
        import torch.distributed.pipelining as pipelining
    except ImportError:
        return True
    return not hasattr(pipelining, schedule)


# A GPU-only test says so in its skip reason; it is legitimate only where CUDA is absent.
NEEDS_GPU = r"needs a (CUDA )?GPU"

# A skip reason (a regular expression, searched) -> whether it is legitimately impossible here.
ALLOWED = {
    NEEDS_GPU: lambda: not _gpu(),
    r"the GPU run is the real benchmark": _gpu,              # the CPU smoke run is the GPU's twin
    r"needs TRITON_INTERPRET=1": _gpu,                        # with a GPU the kernels are compiled
    r"run in a process that sees no GPU": _gpu,               # test_model_kernels.py does that
    r"the interpreter's view of a 4 GiB CPU buffer": _gpu,    # compiled kernels have no such view
    r"PR_SET_PDEATHSIG is Linux's": lambda: not sys.platform.startswith("linux"),
    r"could not import 'tomllib'": lambda: sys.version_info < (3, 11),
    r"could not import 'triton'": lambda: not sys.platform.startswith("linux"),  # Linux wheels only
    # tests/test_browser.py: a system browser that `make test` does not install (`make browser-test`
    # insists on it); skipping is fine only where it really is missing.
    r"needs Chromium and chromedriver": lambda: not _chromium(),
    # tests/test_pipeline_peer.py: torch's zero-bubble schedules arrived after torch 2.4
    r"pipelining has no ScheduleInterleavedZeroBubble": lambda: _pipelining_lacks(
        "ScheduleInterleavedZeroBubble"),
    r"pipelining has no ScheduleZBVZeroBubble": lambda: _pipelining_lacks("ScheduleZBVZeroBubble"),
    r"pipelining has no ScheduleDualPipeV": lambda: _pipelining_lacks("ScheduleDualPipeV"),
    r"needs selenium": lambda: importlib.util.find_spec("selenium") is None,
    # (not "needs transformers": `make test` installs the hf extra, so tests/test_hf.py skipping
    # means the set-up broke)
}


def strict() -> bool:
    return os.environ.get("MINITRON_STRICT", "0") not in ("", "0")


def legitimate(reason: str) -> bool:
    return any(re.search(pattern, reason) and holds() for pattern, holds in ALLOWED.items())


def _reason(longrepr) -> str:
    if isinstance(longrepr, tuple):       # (path, line, "Skipped: reason")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _verdict(reason: str) -> str:
    return (f"MINITRON_STRICT=1: skipped ({reason}), and that reason is not on the allowlist of "
            f"tests/strict_skips.py for this machine: on CPU Linux everything can run")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if strict() and report.skipped and not hasattr(report, "wasxfail"):
        reason = _reason(report.longrepr)
        if not legitimate(reason):
            report.outcome, report.longrepr = "failed", _verdict(reason)
    return report


class StrictSkip(pytest.Item):
    """Stands for a module that skipped itself at import: fails with the reason."""

    def __init__(self, *, reason: str, **kwargs):
        super().__init__(**kwargs)
        self.reason = reason

    def runtest(self):
        pytest.fail(_verdict(self.reason), pytrace=False)

    def reportinfo(self):
        return self.path, None, self.name


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    if strict() and report.skipped and isinstance(collector, pytest.Module):
        reason = _reason(report.longrepr)
        if not legitimate(reason):
            # a child of the module's own parent: setting it up must not import the module again
            item = StrictSkip.from_parent(collector.parent, name="module_skipped", reason=reason,
                                          nodeid=f"{collector.nodeid}::module_skipped",
                                          path=collector.path)
            report.outcome, report.longrepr, report.result = "passed", None, [item]
    return report


def pytest_collection_modifyitems(items):
    """A test that skips itself without a GPU (a skipif whose reason matches NEEDS_GPU) carries
    the `gpu` mark: `pytest -m gpu` (make gpu-check) runs exactly those."""
    for item in items:
        if any(re.search(NEEDS_GPU, str(m.kwargs.get("reason", ""))) for m in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.gpu)
