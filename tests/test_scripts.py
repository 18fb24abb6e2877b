"""scripts/: bash parses them, and every command they would run (DRY_RUN=1 prints them) takes
its flags: torchrun's by torchrun's own parser, minitron.train's and minitron.verify's by their
command lines up to the moment they would start the ranks, on as many ranks as torchrun starts."""
import os
import shlex
import subprocess

import pytest
from torch.distributed.run import get_args_parser

from minitron.train import cli as train_cli, restart
from minitron.verify import cli as verify_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ["single_node.sh", "multi_node.sh", "slurm.sbatch"]
NCCL_NAMES = ["MINITRON_BACKEND=nccl", "NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA",
              "TORCH_NCCL_ASYNC_ERROR_HANDLING"]


def _commands(script: str, tmp_path) -> list[list[str]]:
    """The commands the script would run, with a stand-in scontrol for the Slurm one."""
    shim = tmp_path / "bin"
    shim.mkdir(exist_ok=True)
    # a large allocation's list: its reader must take the first name without closing the pipe
    # early (`| head -n 1` under pipefail ended the script with SIGPIPE, 141, in a loaded run)
    (shim / "scontrol").write_text("#!/bin/sh\necho node-a\nseq -f node-%g 2 200000\n")
    (shim / "scontrol").chmod(0o755)
    env = {**os.environ, "DRY_RUN": "1", "RDZV_HOST": "node-a", "PATH": f"{shim}:{os.environ['PATH']}",
           "SLURM_SUBMIT_DIR": ROOT, "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_NNODES": "2",
           "SLURM_JOB_ID": "42"}
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", script)], capture_output=True,
                          text=True, env=env, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return [shlex.split(line) for line in proc.stdout.splitlines()]


@pytest.mark.parametrize("script", SCRIPTS)
def test_bash_parses_the_script_and_it_names_the_nccl_environment(script):
    path = os.path.join(ROOT, "scripts", script)
    assert subprocess.run(["bash", "-n", path], capture_output=True).returncode == 0
    text = open(path).read() + open(os.path.join(ROOT, "scripts", "common.sh")).read()
    assert all(name in text for name in NCCL_NAMES)
    assert not any(word in text for word in ("curl", "wget", "pip install", "from_pretrained"))


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_command_takes_its_flags_on_the_ranks_torchrun_starts(script, tmp_path, monkeypatch):
    commands = _commands(script, tmp_path)
    assert len(commands) == 2                          # train, then verify
    launched = []

    def stub_launch(fn, *args, world_size, **kwargs):   # where the ranks would start
        launched.append(world_size)
        return [([], None)]

    class Passed:
        passed = True
        table = verdict = staticmethod(lambda: "")

    def stub_verify(pcfg, *args, **kwargs):
        launched.append(pcfg.world_size)
        return Passed()

    monkeypatch.setattr(restart, "launch", stub_launch)     # train/restart.py starts the ranks
    monkeypatch.setattr(verify_cli, "verify", stub_verify)
    monkeypatch.setenv("MINITRON_BACKEND", "gloo")
    wanted = []
    for command in commands:
        torchrun = get_args_parser().parse_args(command[command.index("torchrun") + 1:])
        assert torchrun.module and torchrun.training_script in ("minitron.train", "minitron.verify")
        nodes = int(torchrun.nnodes.split(":")[-1])
        wanted.append(nodes * int(torchrun.nproc_per_node))
        argv = list(torchrun.training_script_args)
        if torchrun.training_script == "minitron.train":
            out = argv.index("--out") + 1
            argv[out] = str(tmp_path / "run")              # not the repository's runs/
            assert train_cli.main(argv) == 0
        else:
            assert verify_cli.main(argv) == 0
    assert launched == wanted and wanted[0] in (8, 16)
