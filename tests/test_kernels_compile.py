"""Every kernel compiled for a Hopper GPU (sm_90) on any machine, and held to its limits.

The interpreter runs kernels as Python, so it accepts code the real compiler rejects (types
that do not unify across a loop, unsupported ops, blocks that do not fit shared memory).
minitron.kernels.compile_check runs Triton's whole CUDA compiler, ptxas included, without a
GPU, and reports registers, spilled bytes and shared memory for each kernel and for every
flash-attention tile autotune may pick.

It runs in a subprocess with TRITON_INTERPRET unset and an empty Triton cache of its own.
In this process triton may already be imported in interpreter mode (tests/conftest.py does
that on a machine without a GPU), and its compiler then fails; a warm cache would skip the
compiler altogether, so a kernel it can no longer compile would still pass.
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")
if importlib.util.find_spec("triton.backends.nvidia") is None:
    pytest.skip("this triton has no CUDA backend", allow_module_level=True)

from minitron.kernels import compile_check  # noqa: E402  (imports no triton)

CASES = [name for name in compile_check.all_case_names() if name not in compile_check.REJECTED_REASONS]
LIMIT = compile_check.SM90_SHARED_LIMIT


def _compile(cache_dir, *only):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")   # triton 3.9 warns when unset
    proc = subprocess.run([sys.executable, "-m", "minitron.kernels.compile_check", "--json",
                           *(["--only", *only] if only else [])],
                          env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, f"compile_check failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """One compile of every case, in a fresh process with a cold cache, started from an
    environment that says TRITON_INTERPRET=1 (as tests/test_kernels.py sets it while its tests
    run): _compile cleans it, or every case would report an interpreted kernel as an error."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TRITON_INTERPRET", "1")
        return _compile(tmp_path_factory.mktemp("triton-cache"))


@pytest.mark.parametrize("case", CASES)
def test_compiles_for_sm90(reports, case):
    report = reports[case]
    assert "error" not in report, report.get("error")
    assert report["cubin_bytes"] > 0, "no cubin came out"
    # what a launch on an H100/H200 needs: the shared memory it has, registers without spills
    assert report["shared_bytes"] <= LIMIT, f"{report['shared_bytes']} B of shared memory > {LIMIT}"
    assert report["spill_bytes"] == 0, f"{report['spill_bytes']} B of registers spilled"


def test_the_limits_catch_the_tiles_they_replaced(reports):
    """A test of the test: tiles dropped from the lists (attention_configs.REJECTED), compiled
    the same way, break the limit recorded for each, so the checks above can fail."""
    for name, why in compile_check.REJECTED_REASONS.items():
        report = reports[name]
        assert "error" not in report, report.get("error")
        broken = {"shared": report["shared_bytes"] > LIMIT, "spills": report["spill_bytes"] > 0}
        assert broken[why], f"{name} was rejected for {why}, but compiles within it: {report}"
