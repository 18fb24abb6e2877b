"""Strict mode (tests/strict_skips.py) turns skips that hide a failure into failures."""
import os
import pathlib
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

import strict_skips

TESTS = pathlib.Path(__file__).resolve().parent

MODULE_SKIP = """
import pytest
pytest.skip("could not import 'triton': planted", allow_module_level=True)

def test_never_collected():
    pass
"""

SKIPS = """
import pytest

def test_passes():
    pass

def test_compiler_api_moved():
    pytest.skip("this triton has no compiler API here: planted")

def test_needs_a_gpu():
    pytest.skip("needs a CUDA GPU")

@pytest.mark.skipif(True, reason="needs TRITON_INTERPRET=1")
def test_marked_for_the_interpreter():
    pass

@pytest.mark.xfail(reason="an expected failure is not a skip")
def test_expected_failure():
    assert False
"""


def _run(tmp_path, strict: bool) -> tuple[int, dict[str, tuple[str, str]]]:
    """pytest with only the strict-skips plugin on two planted files: (exit code, name -> outcome)."""
    (tmp_path / "test_module_skip.py").write_text(MODULE_SKIP)
    (tmp_path / "test_skips.py").write_text(SKIPS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "MINITRON_STRICT": "1" if strict else "0",
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}     # only that plugin: the others cost ~2 s a run
    xml = tmp_path / "report.xml"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "strict_skips", "-p", "no:cacheprovider",
                           "-q", f"--junitxml={xml}", "--rootdir", str(tmp_path), str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    outcomes = {}
    for case in ET.parse(xml).iter("testcase"):
        child = next(iter(case), None)
        outcomes[case.get("name")] = ("passed", "") if child is None else (child.tag, child.get("message", ""))
    return proc.returncode, outcomes


def test_strict_mode_fails_skips_that_are_not_on_the_allowlist(tmp_path):
    code, outcomes = _run(tmp_path, strict=True)
    gpu = strict_skips._gpu()
    assert code == 1
    assert outcomes["module_skipped"][0] == "failure"
    assert "MINITRON_STRICT=1: skipped (could not import 'triton': planted)" in outcomes["module_skipped"][1]
    assert outcomes["test_compiler_api_moved"][0] == "failure"
    assert "skipped (this triton has no compiler API here: planted)" in outcomes["test_compiler_api_moved"][1]
    assert outcomes["test_needs_a_gpu"][0] == ("failure" if gpu else "skipped")
    # a skipif marker skips at set-up, so junit calls its failure an error
    assert outcomes["test_marked_for_the_interpreter"][0] == ("skipped" if gpu else "error")
    assert outcomes["test_expected_failure"][0] == "skipped"       # xfail: untouched
    assert outcomes["test_passes"] == ("passed", "")


def test_without_strict_mode_a_skip_is_a_skip(tmp_path):
    code, outcomes = _run(tmp_path, strict=False)
    assert code == 0
    assert {name: kind for name, (kind, _) in outcomes.items()} == {
        "test_module_skip": "skipped", "test_passes": "passed", "test_compiler_api_moved": "skipped", "test_needs_a_gpu": "skipped",
        "test_marked_for_the_interpreter": "skipped", "test_expected_failure": "skipped"}


@pytest.mark.parametrize("reason,allowed_here", [
    ("could not import 'triton': No module named 'triton'", not sys.platform.startswith("linux")),
    ("ranks on the CPU, but minitron.kernels.rmsnorm was imported before TRITON_INTERPRET=1", False),
    ("this triton has no CUDA backend", False),
    ("kernels were loaded as interpreted functions", False),
    ("PR_SET_PDEATHSIG is Linux's", not sys.platform.startswith("linux")),
])
def test_allowlist_on_this_machine(reason, allowed_here):
    assert strict_skips.legitimate(reason) == allowed_here
