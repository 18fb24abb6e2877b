"""GPU-only: the same code under NCCL on one CUDA rank. Skipped on a CPU (the reason says so, and
tests/strict_skips.py allows that skip only where CUDA is absent); make gpu-check runs them.

Each runs in a child process: other tests in this session may have initialised CUDA here, after
which no NCCL rank can be forked (process_group.check_can_fork)."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.device_count() == 0, reason="needs a CUDA GPU")

NCCL = {**os.environ, "MINITRON_BACKEND": "nccl", "OMP_NUM_THREADS": "1"}


def _python(argv, timeout=120, env=NCCL):
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


RANK_FACTS = """
    import torch, torch.distributed as dist, minitron
    from minitron.runtime import comm

    def facts():
        grid = minitron.build_grid(minitron.ParallelConfig(tp=1))
        t = torch.full((4,), 3.0, device=grid.device)
        op, divide = comm.reduce_plan("avg", dist.get_backend())
        dist.all_reduce(t, op=op)          # NCCL's own AVG on a world of one
        return dist.get_backend(), str(grid.device), str(t.device), divide, t.tolist()

    print(minitron.launch(facts, world_size=1))
"""


def test_a_launched_rank_is_an_nccl_rank_on_cuda_0_with_nccls_own_avg(tmp_path):
    script = tmp_path / "facts.py"
    script.write_text(textwrap.dedent(RANK_FACTS))
    assert _python([str(script)]).splitlines()[-1] == \
        "[('nccl', 'cuda:0', 'cuda:0', False, [3.0, 3.0, 3.0, 3.0])]"


def test_under_torchrun_one_gpu_the_same_script_prints_once(tmp_path):
    script = tmp_path / "facts.py"
    script.write_text(textwrap.dedent(RANK_FACTS))
    out = _python(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", str(script)])
    assert out.splitlines()[-1] == "[('nccl', 'cuda:0', 'cuda:0', False, [3.0, 3.0, 3.0, 3.0])]"


def test_verify_passes_on_one_cuda_rank_with_dropout_masks_drawn_on_the_gpu():
    out = _python(["-m", "minitron.verify", "--tp", "1", "--steps", "2", "--dropout", "0.1"])
    assert out.splitlines()[-1].startswith("PASS")


def test_a_planted_bug_fails_verify_on_the_gpu_too():
    proc = subprocess.run([sys.executable, "-m", "minitron.verify", "--tp", "1", "--steps", "1",
                           "--plant", "grad"], capture_output=True, text=True,
                          timeout=120, env=NCCL)
    assert proc.returncode != 0 and "FAIL" in proc.stdout + proc.stderr


def test_training_on_the_gpu_reports_mfu_against_the_detected_peak(tmp_path):
    out = _python(["-m", "minitron.train", "--steps", "3", "--sample", "0", "--save-every", "0",
                   "--out", str(tmp_path / "run")])
    assert "loss " in out
    assert '"mfu": null' not in (tmp_path / "run" / "metrics.jsonl").read_text()  # H200: a known peak


def test_the_350m_step_runs_eagerly_in_bf16():
    out = _python(["-m", "minitron.bench", "gpu", "--part", "train", "--variants", "eager"], timeout=300)
    assert "eager:" in out and "tokens/s" in out
