"""What a test leaves in this process does not reach the next test on the same xdist worker
(tests/conftest.py, _no_compiled_kernels_left_behind). The two tests run in file order."""
import os

BEFORE = os.environ.get("TRITON_INTERPRET")


def test_a_test_sets_the_interpreter_and_leaves_it_set():
    # as enable_kernels does for a use_kernels model on CPU ranks (minitron.verify, the trainer)
    os.environ["TRITON_INTERPRET"] = "1"


def test_the_next_test_has_the_setting_it_started_with():
    # left set, its ranks' optimizer steps would run in the interpreter: 2x the CPU time
    assert os.environ.get("TRITON_INTERPRET") == BEFORE
